"""The Python client of `jaxserve serve`: an asyncio gRPC Client over one channel; and what `jaxserve client` runs:
a reply's text pieces as they arrive over gRPC (grpc_reply) or the OpenAI-compatible HTTP API through the `openai`
package (http_reply), printed by print_reply. A prompt is text, token ids, or a conversation ([{"role", "content"},
...]) that the server turns into the prompt through the model's chat template.

    from jaxserve import SamplingParams
    from jaxserve.client import Client

    async with Client("127.0.0.1:50051") as client:
        async for response in client.generate("Once upon a time", SamplingParams(max_tokens=32)):
            print(response.outputs[0].text, end="")
        answer = await client.complete([{"role": "user", "content": "Name three colours."}])
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.serve import jaxserve_pb2 as pb
from jaxserve.serve import jaxserve_pb2_grpc as pb_grpc
from jaxserve.serve.jaxserve_pb2 import GenerateResponse, ModelInfoResponse, ServerStatsResponse

__all__ = ["Client", "ClientError", "Prompt", "sampling_options", "generate_request", "grpc_reply", "http_reply",
           "print_reply", "DEFAULT_TARGET", "GenerateResponse", "ModelInfoResponse", "ServerStatsResponse"]

Prompt = str | list[int] | list[dict]   # text, token ids, or a conversation for the model's chat template
DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
CONSTRAINT_OPTIONS = pb.SamplingOptions.DESCRIPTOR.oneofs_by_name["structured_outputs"]


def sampling_fields(params: SamplingParams) -> dict:
    """Every field of params that is set: not None, not left to the server's model (`unset`); structured_outputs
    as vLLM's object of its one field. The server rebuilds the same SamplingParams."""
    values = {f.name: getattr(params, f.name) for f in pb.SamplingOptions.DESCRIPTOR.fields
              if f.containing_oneof is not CONSTRAINT_OPTIONS}
    if (spec := params.structured_outputs) is not None:
        values["structured_outputs"] = {spec.key[0]: getattr(spec, spec.key[0])}
    return {k: v for k, v in values.items() if v is not None and k not in params.unset}


def sampling_options(params: SamplingParams) -> pb.SamplingOptions:
    fields = sampling_fields(params)
    fields.pop("structured_outputs", None)
    return pb.SamplingOptions(**fields, **constraint_option(params.structured_outputs))


def constraint_option(spec: StructuredOutputsParams | None) -> dict:
    """SamplingOptions' structured_outputs field for a constraint: a JSON schema as JSON text, choices as a
    ChoiceList."""
    if spec is None:
        return {}
    kind = spec.key[0]
    if kind == "json":
        return {"json_schema": json.dumps(spec.json)}
    return {"choice": pb.ChoiceList(choices=spec.choice)} if kind == "choice" else {kind: getattr(spec, kind)}


def is_conversation(prompt: Prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def generate_request(prompt: Prompt, params: SamplingParams | None, priority: int,
                     cache_salt: str | None) -> pb.GenerateRequest:
    request = pb.GenerateRequest(sampling=sampling_options(params or SamplingParams()), priority=priority,
                                 cache_salt=cache_salt)
    if isinstance(prompt, str):
        request.prompt = prompt
    elif is_conversation(prompt):
        request.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        request.prompt_token_ids.extend(prompt)
    return request


class Client:
    """One channel to a server. Calls raise grpc.aio.AioRpcError (code() and details() say why)."""

    def __init__(self, target: str = DEFAULT_TARGET, *, root_certificates: bytes | None = None,
                 api_key: str | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if root_certificates is None:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        else:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.aio.secure_channel(target, creds, options=options)
        # every call carries the server's --api-key (the health service needs none)
        self.metadata = None if api_key is None else (("authorization", f"Bearer {api_key}"),)
        self.stub = pb_grpc.JaxServeStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, priority: int = 0,
                       cache_salt: str | None = None, timeout: float | None = None
                       ) -> AsyncIterator[GenerateResponse]:
        """Stream text/token deltas; leaving the loop early cancels the request on the server."""
        call = self.stub.Generate(generate_request(prompt, params, priority, cache_salt), timeout=timeout,
                                  metadata=self.metadata)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def complete(self, prompt: Prompt, params: SamplingParams | None = None, *, priority: int = 0,
                       cache_salt: str | None = None, timeout: float | None = None) -> GenerateResponse:
        return await self.stub.Complete(generate_request(prompt, params, priority, cache_salt), timeout=timeout,
                                        metadata=self.metadata)

    async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        response = await self.stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                                            metadata=self.metadata)
        return list(response.token_ids)

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        request = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return (await self.stub.Detokenize(request, metadata=self.metadata)).text

    async def model_info(self) -> ModelInfoResponse:
        return await self.stub.ModelInfo(pb.ModelInfoRequest(), metadata=self.metadata)

    async def server_stats(self) -> ServerStatsResponse:
        return await self.stub.ServerStats(pb.ServerStatsRequest(), metadata=self.metadata)

    async def health(self, service: str = "") -> str:
        """"SERVING", "NOT_SERVING", ... of the server ("") or of one service (e.g. "jaxserve.v1.JaxServe")."""
        response = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


class ClientError(Exception):
    """A reply that failed, in one line: the server's refusal, or no server at the address."""


async def grpc_reply(target: str, prompt: Prompt, params: SamplingParams, *, root_certificates: bytes | None = None,
                     api_key: str | None = None, timeout: float | None = None) -> AsyncIterator[str]:
    """The reply's text pieces over gRPC as they arrive."""
    async with Client(target, root_certificates=root_certificates, api_key=api_key) as client:
        try:
            async for response in client.generate(prompt, params, timeout=timeout):
                for chunk in response.outputs:
                    yield chunk.text
        except grpc.aio.AioRpcError as e:
            # UNAVAILABLE on a connected channel is the server's own (its engine failed)
            if e.code() == grpc.StatusCode.UNAVAILABLE and client.channel.get_state() != grpc.ChannelConnectivity.READY:
                tls = " over TLS" if root_certificates else ""
                raise ClientError(f"cannot connect to {target} (gRPC{tls}): is `jaxserve serve` running there? Give "
                                  "its --host and --port (its --grpc-port), or --url http://HOST:PORT for its HTTP "
                                  "API") from None
            raise ClientError(f"{e.code().name}: {e.details()}") from None


async def http_reply(url: str, prompt: Prompt, params: SamplingParams, *, api_key: str | None = None,
                     timeout: float | None = None) -> AsyncIterator[str]:
    """The reply's text pieces from the OpenAI-compatible HTTP API at url (its /v1 base URL) as they arrive: a
    conversation through /v1/chat/completions, text or token ids through /v1/completions, as the server's first
    model. The sampling fields travel by their SamplingParams names, which jaxserve (like vLLM) takes."""
    import openai   # only HTTP needs it: it costs every other command most of a second
    chat, body = is_conversation(prompt), sampling_fields(params)
    try:
        async with openai.AsyncOpenAI(base_url=url, api_key=api_key or "none", max_retries=0,
                                      timeout=timeout) as client:
            model = (await client.models.list()).data[0].id
            if chat:
                stream = await client.chat.completions.create(model=model, messages=prompt, stream=True,
                                                              extra_body=body)
            else:
                stream = await client.completions.create(model=model, prompt=prompt, stream=True, extra_body=body)
            async for chunk in stream:
                for choice in chunk.choices:
                    yield (choice.delta.content or "") if chat else choice.text
    except openai.APITimeoutError:
        raise ClientError(f"{url}: no reply within the timeout ({timeout} s)") from None
    except openai.APIConnectionError:
        raise ClientError(f"cannot connect to {url}: is `jaxserve serve` running there (its --port)?") from None
    except openai.APIError as e:   # a status, or an error event in the stream: the server's message
        message = e.body.get("message", e.message) if isinstance(e.body, dict) else e.message
        status = f"HTTP {e.status_code}: " if isinstance(e, openai.APIStatusError) else ""
        raise ClientError(status + message) from None


async def print_reply(pieces: AsyncIterator[str]) -> None:
    """Each text piece to stdout as it arrives, then a newline (`jaxserve client`)."""
    async for text in pieces:
        print(text, end="", flush=True)
    print(flush=True)
