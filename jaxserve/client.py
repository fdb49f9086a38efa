"""The Python client of `jaxserve serve`: an asyncio gRPC Client over one channel, and print_completion behind
`jaxserve client`. (The HTTP API takes any OpenAI client.)

    from jaxserve import SamplingParams
    from jaxserve.client import Client

    async with Client("127.0.0.1:50051") as client:
        async for response in client.generate("Once upon a time", SamplingParams(max_tokens=32)):
            print(response.outputs[0].text, end="")
"""
from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.serve import jaxserve_pb2 as pb
from jaxserve.serve import jaxserve_pb2_grpc as pb_grpc
from jaxserve.serve.jaxserve_pb2 import GenerateResponse, ModelInfoResponse, ServerStatsResponse

__all__ = ["Client", "sampling_options", "generate_request", "print_completion", "DEFAULT_TARGET",
           "GenerateResponse", "ModelInfoResponse", "ServerStatsResponse"]

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20


def sampling_options(params: SamplingParams) -> pb.SamplingOptions:
    """Every field of params that is not None (the server rebuilds the same SamplingParams)."""
    values = {f.name: getattr(params, f.name) for f in pb.SamplingOptions.DESCRIPTOR.fields}
    return pb.SamplingOptions(**{k: v for k, v in values.items() if v is not None})


def generate_request(prompt: str | list[int], params: SamplingParams | None, priority: int,
                     cache_salt: str | None) -> pb.GenerateRequest:
    text, ids = (prompt, []) if isinstance(prompt, str) else ("", list(prompt))
    return pb.GenerateRequest(prompt=text, prompt_token_ids=ids, sampling=sampling_options(params or SamplingParams()),
                              priority=priority, cache_salt=cache_salt)


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

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *, priority: int = 0,
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

    async def complete(self, prompt: str | list[int], params: SamplingParams | None = None, *, priority: int = 0,
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


async def print_completion(target: str, prompt: str, params: SamplingParams, *, root_certificates: bytes | None = None,
                           api_key: str | None = None, timeout: float | None = None) -> None:
    """Stream one completion's text to stdout as it arrives (`jaxserve client`)."""
    async with Client(target, root_certificates=root_certificates, api_key=api_key) as client:
        async for response in client.generate(prompt, params, timeout=timeout):
            for chunk in response.outputs:
                print(chunk.text, end="", flush=True)
    print(flush=True)
