"""The gRPC front end of `jaxserve serve`: the JaxServe service (jaxserve.proto) over the engine loop, beside the
OpenAI-compatible HTTP one (openai_http.py). A request is converted, checked, chat-templated (its messages, if
any) and tokenized on the engine loop's tokenizer thread; its cumulative RequestOutputs become one response
(Complete) or a stream of per-completion deltas (Generate). A cancelled call aborts its request at once. Refusals
and failures map to status codes (GRPC_CODES), an undecodable request to INVALID_ARGUMENT (as does an invalid
structured-outputs constraint, compiled on the tokenizer thread too, naming its field), and with an api key every
call but the health service's needs `authorization: Bearer <key>`. `grpc_server` makes the grpc.aio server with the
service on it."""
from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health
from jinja2 import TemplateError

from jaxserve.engine.llm import apply_chat_template
from jaxserve.engine.llm_engine import AdmissionError
from jaxserve.engine.sampling_params import (DEFAULT_MAX_TOKENS, SamplingParams, StructuredOutputsParams,
                                             default_max_tokens)
from jaxserve.engine.sequence import CompletionOutput, RequestOutput
from jaxserve.serve import jaxserve_pb2 as pb
from jaxserve.serve import jaxserve_pb2_grpc as pb_grpc
from jaxserve.serve.connections import bearer_matches
from jaxserve.serve.engine_loop import REFUSALS, EngineFacts, EngineFailed, EngineLoop, Overloaded, Submission
from jaxserve.serve.metrics import RequestTimer, ServerMetrics

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name
STATS_FIELDS = frozenset(pb.ServerStatsResponse.DESCRIPTOR.fields_by_name)   # of the engine loop's stats
# SamplingOptions' structured_outputs -> StructuredOutputsParams' field
STRUCTURED_OPTIONS = {"json_schema": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
                      "grammar": "grammar"}

# error -> status of the call; the first that matches
GRPC_CODES = ((AdmissionError, grpc.StatusCode.RESOURCE_EXHAUSTED), (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
              (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED), (EngineFailed, grpc.StatusCode.UNAVAILABLE))


def grpc_server(servicer: JaxServeServicer, api_key: str | None, max_message_bytes: int) -> grpc.aio.Server:
    """A grpc.aio server with the JaxServe service on it (and, with api_key, the interceptor that checks it: grpc.aio
    takes interceptors only when the server is made). Other services, ports and start are the caller's."""
    server = grpc.aio.server(interceptors=() if api_key is None else (BearerInterceptor(api_key),),
                             options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.max_send_message_length", max_message_bytes),
                                      ("grpc.so_reuseport", 0)])
    add_servicer(servicer, server)
    return server


# ---- the service ----------------------------------------------------------------------------------------
class JaxServeServicer(pb_grpc.JaxServeServicer):
    def __init__(self, engine_loop: EngineLoop, metrics: ServerMetrics, model_name: str, scheduling_policy: str):
        self.engine_loop, self.metrics, self.scheduling_policy = engine_loop, metrics, scheduling_policy
        self.facts = engine_loop.facts   # its tokenizer and thread-safe tokenize, on the tokenizer thread
        self.info = model_info(self.facts, model_name)

    async def Generate(self, request, context):
        sent: dict[int, tuple[int, int, bool]] = {}
        async with contextlib.aclosing(self._outputs(request, context)) as outputs:   # a cancel aborts at once
            async for out in outputs:
                yield delta_response(out, sent)

    async def Complete(self, request, context):
        async with contextlib.aclosing(self._outputs(request, context)) as outputs:
            async for last in outputs:
                pass
        return full_response(last)

    async def Tokenize(self, request, context):
        ids = await self._off_engine(context, self.facts.tokenize, request.text, request.add_special_tokens)
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request, context):
        text = await self._off_engine(context, detokenize, self.facts, request.token_ids,
                                      request.skip_special_tokens)
        return pb.DetokenizeResponse(text=text)

    async def ModelInfo(self, request, context):
        return self.info

    async def ServerStats(self, request, context):
        return pb.ServerStatsResponse(**{k: v for k, v in self.engine_loop.stats().items() if k in STATS_FIELDS})

    async def _outputs(self, request, context) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs (engine_loop.generate); a refusal or failure ends the call."""
        timer = RequestTimer(self.metrics)
        try:
            submission = await self.engine_loop.off_engine(self._submission, request)
            async with contextlib.aclosing(self.engine_loop.generate(submission, timer)) as outputs:
                async for out in outputs:
                    yield out
        except REFUSALS as e:
            timer.end(e)
            await abort(context, e)

    def _submission(self, request) -> Submission:
        """On the tokenizer thread: the request converted, checked and tokenized."""
        prompt = request_prompt(request, self.facts)
        params = sampling_params(request.sampling, self.facts.sampling_defaults)
        if params.structured_outputs is not None:   # here, so that the engine's thread never compiles one
            with proto_names():
                self.engine_loop.compile_grammar(params.structured_outputs)
        if request.priority and self.scheduling_policy == "fcfs":
            raise ValueError("priority: this server serves first come, first served (start it with "
                             "--scheduling-policy priority to honour priorities)")
        cache_salt = request.cache_salt if request.HasField("cache_salt") else None
        return Submission(prompt, self.engine_loop.prompt_ids(prompt), params, request.priority, cache_salt)

    async def _off_engine(self, context, fn, *args):
        try:
            return await self.engine_loop.off_engine(fn, *args)
        except ValueError as e:
            await abort(context, e)


async def abort(context, error: Exception):
    await context.abort(next(code for kind, code in GRPC_CODES if isinstance(error, kind)), str(error))


# ---- registration ---------------------------------------------------------------------------------------
def add_servicer(servicer: JaxServeServicer, server: grpc.aio.Server) -> None:
    """The generated registration, but an undecodable request gets INVALID_ARGUMENT (grpc's own deserializer
    failure is an opaque UNKNOWN)."""
    handlers = {}
    pb_grpc.add_JaxServeServicer_to_server(servicer, Registrar(handlers))
    handlers = {name: refuse_undecodable(h) for name, h in handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class Registrar:
    """Collects the method handlers that the generated code registers."""

    def __init__(self, handlers: dict):
        self.handlers = handlers

    def add_generic_rpc_handlers(self, _):
        pass

    def add_registered_method_handlers(self, _, handlers):
        self.handlers.update(handlers)


class Undecodable:
    """What a request that is not a valid protobuf message of its type deserializes to."""

    def __init__(self, error: DecodeError):
        self.error = error


def refuse_undecodable(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def deserialize(data: bytes):
        try:
            return handler.request_deserializer(data)
        except DecodeError as e:
            return Undecodable(e)

    async def check(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message ({request.error})")

    if handler.unary_stream is not None:
        async def unary_stream(request, context):
            await check(request, context)
            async for response in handler.unary_stream(request, context):
                yield response
        return handler._replace(request_deserializer=deserialize, unary_stream=unary_stream)

    async def unary_unary(request, context):
        await check(request, context)
        return await handler.unary_unary(request, context)
    return handler._replace(request_deserializer=deserialize, unary_unary=unary_unary)


class BearerInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless a call carries the metadata `authorization: Bearer <key>`; the health service stays
    open to probes."""

    def __init__(self, key: str):
        self.key = key

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(f"/{health.SERVICE_NAME}/"):
            return handler
        if bearer_matches(dict(details.invocation_metadata or ()).get("authorization"), self.key):
            return handler
        return refusing(handler)


def refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """handler's kind of method, answering UNAUTHENTICATED."""
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: Bearer <api key> missing or wrong "
                                                             "(call metadata)")

    async def refuse_stream(request, context):
        await refuse(request, context)
        yield

    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
    return handler._replace(**{kind: refuse_stream if kind.endswith("_stream") else refuse})


# ---- requests -------------------------------------------------------------------------------------------
def sampling_params(options: pb.SamplingOptions, model_defaults: dict) -> SamplingParams:
    """Set fields only; the rest take SamplingParams' defaults, the model's where it has them (temperature, top_p,
    top_k, min_p, repetition_penalty: the engine applies them; max_tokens: its max_new_tokens). SamplingParams
    validates (ValueError)."""
    kwargs = {f.name: v if isinstance(v, (bool, int, float, str)) else list(v) for f, v in options.ListFields()
              if f.name not in STRUCTURED_OPTIONS}
    kwargs.setdefault("max_tokens", default_max_tokens(model_defaults, DEFAULT_MAX_TOKENS))
    return SamplingParams(**kwargs, structured_outputs=structured_outputs(options))


def structured_outputs(options: pb.SamplingOptions) -> StructuredOutputsParams | None:
    if (kind := options.WhichOneof("structured_outputs")) is None:
        return None
    value = list(options.choice.choices) if kind == "choice" else getattr(options, kind)
    with proto_names():
        return StructuredOutputsParams(**{STRUCTURED_OPTIONS[kind]: value})


@contextlib.contextmanager
def proto_names():
    """A ValueError naming a structured_outputs field as SamplingOptions does: its `json` is json_schema."""
    try:
        yield
    except ValueError as e:
        raise ValueError(re.sub(r"^structured_outputs\.json\b", "structured_outputs.json_schema", str(e))) from None


def request_prompt(request: pb.GenerateRequest, facts: EngineFacts) -> str | list[int]:
    """The prompt: text, token ids (counted before they are converted: a 16 MiB message holds millions), or the
    messages through the model's chat template."""
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(request, name)]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: give one of prompt, prompt_token_ids and messages")
    if request.messages:
        return chat_prompt(request.messages, facts.tokenizer)
    if not request.prompt_token_ids:
        return request.prompt
    facts.check_prompt_length(len(request.prompt_token_ids))
    return list(request.prompt_token_ids)


def chat_prompt(messages, tokenizer) -> str:
    """The conversation as prompt text through the model's chat template, as /v1/chat/completions makes it."""
    if tokenizer is None:
        raise ValueError("messages: this model has no tokenizer; send prompt_token_ids")
    try:
        return apply_chat_template(tokenizer, [{"role": m.role, "content": m.content} for m in messages])
    except TemplateError as e:   # the template's own checks, e.g. roles that must alternate
        raise ValueError(f"messages: {e}") from None


def detokenize(facts: EngineFacts, ids, skip_special_tokens: bool) -> str:
    """ids: a sequence (a protobuf repeated field), counted before it is converted."""
    vocab = facts.model_config.vocab_size
    if facts.tokenizer is None:
        raise ValueError("token_ids: this model has no tokenizer")
    if len(ids) > facts.cfg.max_model_len:   # no sequence is longer: more is work on the shared tokenizer thread
        raise ValueError(f"token_ids: at most max_model_len={facts.cfg.max_model_len} ids, got {len(ids):,}")
    if any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"token_ids must be in [0, {vocab})")
    return facts.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


# ---- responses ------------------------------------------------------------------------------------------
def token_logprobs(token: int, logprobs: dict[int, float]) -> pb.TokenLogprobs:
    top = [pb.TopLogprob(token_id=t, logprob=lp) for t, lp in logprobs.items()]
    return pb.TokenLogprobs(token_id=token, logprob=logprobs[token], top=top)


def completion_chunk(c: CompletionOutput, text_from: int = 0, tokens_from: int = 0) -> pb.CompletionChunk:
    ids = c.token_ids[tokens_from:]
    chunk = pb.CompletionChunk(index=c.index, text=c.text[text_from:], token_ids=ids,
                               finish_reason=c.finish_reason or "")
    if c.logprobs is not None:   # the engine's list keeps growing: cut it at this output's length
        chunk.logprobs.extend(map(token_logprobs, ids, c.logprobs[tokens_from:len(c.token_ids)]))
    if isinstance(c.stop_reason, str):
        chunk.stop_str = c.stop_reason
    elif isinstance(c.stop_reason, int):
        chunk.stop_token_id = c.stop_reason
    return chunk


def usage(out: RequestOutput) -> pb.Usage:
    return pb.Usage(prompt_tokens=len(out.prompt_token_ids),
                    completion_tokens=sum(len(c.token_ids) for c in out.outputs))


def delta_response(out: RequestOutput, sent: dict[int, tuple[int, int, bool]]) -> pb.GenerateResponse:
    """What changed since `sent` (index -> chars, tokens, finished already sent), which it updates."""
    response = pb.GenerateResponse(request_id=out.request_id, finished=out.finished)
    for c in out.outputs:
        chars, tokens, done = sent.get(c.index, (0, 0, False))
        if len(c.text) > chars or len(c.token_ids) > tokens or (c.finish_reason is not None and not done):
            response.outputs.append(completion_chunk(c, chars, tokens))
            sent[c.index] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
    if out.finished:
        response.usage.CopyFrom(usage(out))
        response.prompt_logprobs.extend(prompt_logprobs(out))
    return response


def full_response(out: RequestOutput) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=out.request_id, finished=out.finished,
                               outputs=[completion_chunk(c) for c in out.outputs], usage=usage(out),
                               prompt_logprobs=prompt_logprobs(out))


def prompt_logprobs(out: RequestOutput) -> list[pb.TokenLogprobs]:
    """Prompt tokens from the second on (the first has no context), each with its top-k."""
    if out.prompt_logprobs is None:
        return []
    return [token_logprobs(t, lp) for t, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def model_info(facts: EngineFacts, model_name: str) -> pb.ModelInfoResponse:
    mc, cfg = facts.model_config, facts.cfg
    return pb.ModelInfoResponse(
        model=model_name, arch=mc.arch, dtype=facts.dtype,
        device=facts.device_kind, vocab_size=mc.vocab_size, max_model_len=cfg.max_model_len,
        num_layers=mc.num_layers, hidden_size=mc.hidden_size, num_heads=mc.num_heads,
        num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, eos_token_ids=facts.eos_token_ids,
        has_tokenizer=facts.tokenizer is not None, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens)
