"""The OpenAI-compatible HTTP front end of `jaxserve serve` (on --port): /v1/completions and /v1/chat/completions
(server-sent events when streaming, ending with `data: [DONE]`), /v1/models, /health and /metrics (unless the server
turns it off). A Starlette app served by uvicorn in the server's event loop (beside gRPC's), over the engine loop.
A request body is parsed, chat-templated and tokenized on the engine loop's tokenizer thread; its cumulative
RequestOutputs become an OpenAI response, or chunks of per-choice deltas. A list of prompts on /v1/completions is
one engine request per prompt, batched in the engine and answered together (choice i * n + j: prompt i's output
j); one refused prompt refuses them all. A client that disconnects aborts its requests at once. Errors are
OpenAI-shaped: {"error": {"message", "type", "param", "code"}}. Sampling fields a request leaves out (or null) take
the model's defaults (its generation config; the engine applies them).

vLLM's extra request fields are taken too: the SamplingParams ones below, `cache_salt` (a prefix-cache namespace)
and `return_token_ids` (each choice, or chunk's choice, carries its new `token_ids`). Structured outputs, as vLLM
serves them: OpenAI's `response_format` (text, json_object, json_schema) or vLLM's `structured_outputs` (one of
json, json_object, regex, choice, grammar), compiled on the tokenizer thread; errors name the field as the request
spelled it (response_format.json_schema.schema, structured_outputs.regex). Tool calling (tool_calls.py), as vLLM
serves it: the tools shown to the chat template; tool_choice "required" or a named function constrains the output to
an array of calls, "auto" reads the model's own calls back with the server's parser (--tool-call-parser, else the one
its chat template tells); the calls come back as message.tool_calls, or streamed as delta.tool_calls, one parser per
choice. A model without a tokenizer (random benchmark weights) serves token-id prompts (`prompt` as a list of ints)
with empty `text`; chat and text prompts get a 400."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import uvicorn
from jinja2 import TemplateError
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import jaxserve
from jaxserve.engine.llm import apply_chat_template
from jaxserve.engine.llm_engine import AdmissionError, NeverFits
from jaxserve.engine.sampling_params import (STRUCTURED_KINDS, SamplingParams, StructuredOutputsParams,
                                             default_max_tokens, short)
from jaxserve.engine.sequence import CompletionOutput, RequestOutput
from jaxserve.serve.connections import (SEND_BUFFER_BYTES, ConnectionLimits, bearer_matches, guarded_protocol,
                                        quiet_accept_failures)
from jaxserve.serve.engine_loop import REFUSALS, EngineLoop, Overloaded, Submission
from jaxserve.serve.metrics import RequestTimer, ServerMetrics
from jaxserve.serve.tool_calls import (ToolCallStream, ToolRequest, chat_messages, check_tools, constraint_schema,
                                       finish_reason, parse_tool_calls, template_parser)

# request fields (OpenAI's, and vLLM's extensions) that are SamplingParams fields of the same name and meaning
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens",
                   "include_stop_str_in_output")
ENGINE_FIELDS = {*SAMPLING_FIELDS, "max_tokens", "logprobs", "prompt", "cache_salt",   # engine errors name first
                 "structured_outputs"}
UNSUPPORTED = ("echo", "suffix", "logit_bias")
# OpenAI's deprecated function calling, which tools replaced
LEGACY_TOOL_FIELDS = ("functions", "function_call")
# vLLM's guided decoding fields, which its structured_outputs replaced
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                 "guided_whitespace_pattern")
# every other field a request may set; `user` (OpenAI's end-user id) changes nothing. Any other non-null field is a
# 400 naming it: a field silently ignored would change what the client gets without telling it
COMMON_FIELDS = {*SAMPLING_FIELDS, "model", "max_tokens", "stream", "stream_options", "logprobs", "cache_salt",
                 "return_token_ids", "user", "response_format", "structured_outputs"}
ENDPOINT_FIELDS = {False: COMMON_FIELDS | {"prompt"},
                   True: COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                          "parallel_tool_calls"}}
TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens"}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_FIELDS = {"name", "description", "schema", "strict"}   # OpenAI's response_format.json_schema
# the engine's names of the constraint's fields -> response_format's, for a constraint given there
RESPONSE_FORMAT_RENAMES = {"structured_outputs": "response_format",
                           "structured_outputs.json": "response_format.json_schema.schema"}
# ... and for a forced tool call's, which the tools' parameters make
TOOL_CONSTRAINT_RENAMES = {"structured_outputs": "tools", "structured_outputs.json": "tools"}
FIELD_PATH = re.compile(r"[a-z_]*(?:\[\d+\]|\.[a-z_]+)*")   # tools[2].function.name
DEFAULT_COMPLETION_TOKENS = 16   # OpenAI's for /v1/completions; chat runs up to max_model_len
MIN_LOGPROB = -9999.0            # what -inf is sent as (vLLM's choice)
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}   # the rest: invalid_request_error


class APIError(ValueError):
    """An OpenAI-shaped error; a ValueError, so the requests metric counts it as invalid input."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status)


def api_error(error: Exception, renames: dict[str, str]) -> APIError:
    """A refusal as an OpenAI error, `param` the field its message names first (in the request's own terms).
    AdmissionError: a request that can never fit the KV pool is the client's to change, 400 (as OpenAI answers a
    context too long; not 413, which clients and proxies take for a body-size limit); a full queue is 429, as is
    Overloaded; EngineFailed is 503."""
    if isinstance(error, APIError):
        return error
    message = str(error)
    if isinstance(error, AdmissionError):
        status, code = (400, "context_length_exceeded") if isinstance(error, NeverFits) else (429, "queue_full")
    elif isinstance(error, ValueError):
        status, code = 400, None
    else:
        status, code = (429, "server_overloaded") if isinstance(error, Overloaded) else (503, "engine_failed")
    name = re.match(r"[a-z_]*(?:\.[a-z_]+)*", message)[0]   # a field, or a path into one: structured_outputs.regex
    if "." in name and name in renames:   # a path the request spells otherwise is renamed in the message too
        message = renames[name] + message[len(name):]
    param = renames.get(name, name) if name.partition(".")[0] in ENGINE_FIELDS else None
    return APIError(status, message, param, code)


# ---- requests ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Parsed:
    submissions: list[Submission]   # one per prompt
    batch: bool               # `prompt` was a list of prompts: errors name prompt[i]
    chat: bool
    stream: bool
    include_usage: bool
    token_ids: bool           # return_token_ids: choices carry their token ids
    renames: dict[str, str]   # engine field name -> this request's
    tools: ToolRequest | None = None   # tool calls are read out of the outputs (chat with tools, tool_choice not none)
    tool_parser: str | None = None     # how, under tool_choice auto


def json_object(body: bytes) -> dict:
    """The body as a JSON object whose every string (keys too) is valid Unicode, nested no deeper than Python's
    recursion limit lets the parser go: a 400 otherwise, never a 500 or an error on the engine's thread."""
    try:
        value = json.loads(body)
        json.dumps(value, ensure_ascii=False).encode()
    except RecursionError:
        raise APIError(400, "body: JSON nested too deeply") from None
    except UnicodeEncodeError:   # JSON's "\ud800" escapes parse into lone surrogates
        name = invalid_text_field(value)
        raise APIError(400, f"{name}: not valid Unicode (a lone surrogate)", name) from None
    except ValueError as e:   # UnicodeDecodeError included
        raise APIError(400, f"body: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise APIError(400, f"body must be a JSON object, got {type(value).__name__}")
    return value


def invalid_text_field(request) -> str:
    """The top-level field holding a string (or key) that is not valid Unicode; "body" for the body itself."""
    for name, value in request.items() if isinstance(request, dict) else ():
        pending = [name, value]
        while pending:
            item = pending.pop()
            if isinstance(item, str) and not valid_text(item):
                return name if valid_text(name) else "body"   # the field's name goes back in the error
            pending.extend([*item.keys(), *item.values()] if isinstance(item, dict) else
                           item if isinstance(item, list) else ())
    return "body"


def valid_text(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def flag(mapping: dict, name: str, within: str = "") -> bool:
    value = mapping.get(name)
    if value is not None and not isinstance(value, bool):
        raise APIError(400, f"{within}{name} must be a bool, got {short(value)}", within + name)
    return bool(value)


def optional_str(mapping: dict, name: str, within: str = "") -> str | None:
    value = mapping.get(name)
    if value is not None and not isinstance(value, str):
        raise APIError(400, f"{within}{name} must be a string, got {short(value)}", within + name)
    return value


def field_error(error: ValueError) -> APIError:
    """A ValueError whose message starts with the path of the field it is about ("messages[3].tool_call_id: ..."),
    as a 400 naming that path."""
    return APIError(400, str(error), FIELD_PATH.match(str(error))[0] or None)


def field_renames(request: dict, chat: bool) -> dict[str, str]:
    constraint = RESPONSE_FORMAT_RENAMES if request.get("structured_outputs") is None else {}
    if not chat:
        return constraint
    if request.get("tool_choice") not in (None, "none", "auto"):   # a forced call: the constraint is the tools'
        constraint = TOOL_CONSTRAINT_RENAMES
    max_tokens = "max_completion_tokens" if request.get("max_completion_tokens") is not None else "max_tokens"
    return {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": max_tokens, **constraint}


def sampling_params(request: dict, chat: bool, model_defaults: dict,
                    tools: ToolRequest | None = None) -> SamplingParams:
    """The request's fields; those it leaves out or null are left unset, for the model's defaults."""
    kwargs = {name: request[name] for name in SAMPLING_FIELDS if request.get(name) is not None}
    max_tokens = request.get("max_completion_tokens") if chat else None
    max_tokens = request.get("max_tokens") if max_tokens is None else max_tokens
    default = None if chat else default_max_tokens(model_defaults, DEFAULT_COMPLETION_TOKENS)
    return SamplingParams(**kwargs, max_tokens=default if max_tokens is None else max_tokens,
                          logprobs=num_logprobs(request, chat), structured_outputs=output_constraint(request, tools))


def output_constraint(request: dict, tools: ToolRequest | None) -> StructuredOutputsParams | None:
    """What the output keeps to: under a forced tool call the array of calls (vLLM's way), else the request's
    structured outputs; not both."""
    given, calls = structured_outputs(request), None if tools is None else constraint_schema(tools)
    if calls is None:
        return given
    if given is not None:
        other = "response_format" if request.get("structured_outputs") is None else "structured_outputs"
        raise APIError(400, f"tool_choice and {other}: tool_choice 'required' or a function constrains the output to "
                            "tool calls; give one of them", "tool_choice")
    return StructuredOutputsParams(json=calls)


def structured_outputs(request: dict) -> StructuredOutputsParams | None:
    """The request's constraint: vLLM's structured_outputs, or OpenAI's response_format (not both)."""
    response_format, given = request.get("response_format"), request.get("structured_outputs")
    if given is None:
        return None if response_format is None else response_format_constraint(response_format)
    if response_format is not None and response_format != {"type": "text"}:
        raise APIError(400, "response_format and structured_outputs: give one of them", "response_format")
    if not isinstance(given, dict):
        raise APIError(400, f"structured_outputs must be an object with one of {', '.join(STRUCTURED_KINDS)}, got "
                            f"{short(given)}", "structured_outputs")
    check_fields(given, set(STRUCTURED_KINDS), within="structured_outputs.")
    return StructuredOutputsParams(**{kind: value for kind, value in given.items() if value is not None})


def response_format_constraint(response_format) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text (none), json_object, or json_schema {name, schema, description, strict}.
    `name` is required, as vLLM and OpenAI have it; `strict` changes nothing: an output always follows its schema."""
    if not isinstance(response_format, dict) or response_format.get("type") not in RESPONSE_FORMATS:
        raise APIError(400, f"response_format must be {{\"type\": one of {', '.join(RESPONSE_FORMATS)}}}, got "
                            f"{short(response_format)}", "response_format")
    check_fields(response_format, {"type", "json_schema"}, within="response_format.")
    kind, spec, name = response_format["type"], response_format.get("json_schema"), "response_format.json_schema"
    if kind != "json_schema":
        if spec is not None:
            raise APIError(400, f"{name}: given with type {kind!r}; its type is 'json_schema'", name)
        return None if kind == "text" else StructuredOutputsParams(json_object=True)
    if not isinstance(spec, dict):
        raise APIError(400, f"{name} must be an object {{name, schema}}, got {short(spec)}", name)
    check_fields(spec, JSON_SCHEMA_FIELDS, within=f"{name}.")
    if not isinstance(spec.get("name"), str):
        raise APIError(400, f"{name}.name must be a string, got {short(spec.get('name'))}", f"{name}.name")
    optional_str(spec, "description", within=f"{name}.")
    flag(spec, "strict", within=f"{name}.")
    if not isinstance(spec.get("schema"), dict):
        raise APIError(400, f"{name}.schema must be a JSON schema (an object), got {short(spec.get('schema'))}",
                       f"{name}.schema")
    return StructuredOutputsParams(json=spec["schema"])


def num_logprobs(request: dict, chat: bool) -> int | None:
    """Top logprobs per token (None: none). Completions: `logprobs` is the count; chat: a bool, `top_logprobs`
    the count."""
    if not chat:
        return request.get("logprobs")
    top = request.get("top_logprobs")
    if top is not None and not flag(request, "logprobs"):
        raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
    return (0 if top is None else top) if flag(request, "logprobs") else None


def check_fields(request: dict, known: set[str], within: str = "") -> None:
    """Every non-null field known; `within`: the path of a nested object's fields."""
    if unknown := sorted(name for name, value in request.items() if value is not None and name not in known):
        raise APIError(400, f"{within}{unknown[0]}: not a field this server implements", within + unknown[0])


def token_list(request: dict, name: str, vocab_size: int, max_len: int) -> list[int]:
    ids = request.get(name)
    if not (isinstance(ids, list) and len(ids) <= max_len
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids)):
        raise APIError(400, f"{name} must be a list of at most {max_len:,} token ids in [0, {vocab_size})", name)
    return ids


def completion_prompts(request: dict) -> tuple[list, bool]:
    """The prompts, each text or token ids, and whether `prompt` was a list of them (a batch); a string or a list of
    token ids is one prompt (anything else the engine refuses, naming it)."""
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt, True
    return [prompt], False


def refusal(error: Exception, renames: dict[str, str], prompt_index: int | None) -> APIError:
    """api_error, its message naming the prompt of a batch it is about: "prompt[2] has 600 tokens; ...",
    "prompt[2]: max_tokens=480 ..." (`param` stays the field the error is about)."""
    e = api_error(error, renames)
    if prompt_index is None:
        return e
    message, named = re.subn(r"^prompt\b", f"prompt[{prompt_index}]", str(e))
    return APIError(e.status, message if named else f"prompt[{prompt_index}]: {e}", e.param, e.code)


# ---- responses ------------------------------------------------------------------------------------------
def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    completion = sum(len(c.token_ids) for out in outs for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Reply:
    """One request's response: whole, or chunks of per-choice deltas of its prompts' cumulative outputs. Prompt i's
    output j is choice i * n + j, as OpenAI and vLLM number a batch's choices."""

    def __init__(self, parsed: Parsed, model: str, token_text: Callable[[int], str]):
        self.chat, self.include_usage, self.token_text = parsed.chat, parsed.include_usage, token_text
        self.token_ids, self.tools, self.tool_parser = parsed.token_ids, parsed.tools, parsed.tool_parser
        self.tool_streams: dict[int, ToolCallStream] = {}   # choice -> the calls streamed so far
        params = parsed.submissions[0].params   # the prompts share them
        self.n, self.num_top = params.n, params.logprobs
        self.head = {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                     "model": model}
        self.sent: dict[int, tuple[int, int, bool]] = {}   # choice -> characters, tokens, finish reason sent

    def full(self, outs: list[RequestOutput]) -> dict:
        choices = [self.whole_choice(i * self.n + c.index, c) for i, out in enumerate(outs)
                   for c in sorted(out.outputs, key=lambda c: c.index)]
        return {**self.header(chunk=False), "choices": choices, "usage": usage(outs)}

    def chunks(self, prompt_index: int, out: RequestOutput) -> Iterator[dict]:
        """The chunks of each choice of the prompt's that changed since the last call (OpenAI sends one choice per
        chunk)."""
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            seen = index in self.sent
            chars, tokens, done = self.sent.get(index, (0, 0, False))
            if seen and len(c.text) == chars and len(c.token_ids) == tokens and (done or c.finish_reason is None):
                continue
            self.sent[index] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
            for choice in self.delta_choices(index, c, chars, tokens, first=not seen):
                yield {**self.header(chunk=True), "choices": [choice]}

    def usage_chunk(self, outs: list[RequestOutput]) -> dict:
        return {**self.header(chunk=True), "choices": [], "usage": usage(outs)}

    def header(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {**self.head, "object": kind, **({"usage": None} if chunk and self.include_usage else {})}

    def whole_choice(self, index: int, c: CompletionOutput) -> dict:
        if not self.chat:
            return self.choice(index, c, {"text": c.text}, c.finish_reason)
        if self.tools is None:
            return self.choice(index, c, {"message": {"role": "assistant", "content": c.text}}, c.finish_reason)
        content, calls = parse_tool_calls(c.text, self.tools, self.tool_parser)
        message = {"role": "assistant", "content": content if content or not calls else None,
                   **({"tool_calls": [call.message() for call in calls]} if calls else {})}
        return self.choice(index, c, {"message": message}, finish_reason(c.finish_reason, calls))

    def delta_choices(self, index: int, c: CompletionOutput, chars: int, tokens: int, first: bool) -> list[dict]:
        """Choice `index`'s chunks of what follows `chars` characters and `tokens` tokens: a delta each (a tool call
        takes two: its name, then its arguments), the new tokens' logprobs and ids on the first, the finish reason
        on the last."""
        text, reason = c.text[chars:], c.finish_reason
        if not self.chat:
            bodies = [{"text": text}]
        else:
            if self.tools is None:
                deltas = [{"content": text}] if text or first else [{}]
            else:
                deltas, reason = self.tool_deltas(index, c)
                if not (deltas or first or reason or self.token_ids or c.logprobs is not None):
                    return []   # a call still being written, and nothing else to send
                deltas = deltas or [{}]
            if first:
                deltas[0] = {"role": "assistant", **deltas[0]}
            bodies = [{"delta": delta} for delta in deltas]
        return [self.choice(index, c, body, reason if i == len(bodies) - 1 else None, tokens if i == 0 else None)
                for i, body in enumerate(bodies)]

    def tool_deltas(self, index: int, c: CompletionOutput) -> tuple[list[dict], str | None]:
        """The deltas of the content and calls decided since the choice's last output, and its finish reason."""
        stream = self.tool_streams.setdefault(index, ToolCallStream(self.tools, self.tool_parser))
        deltas = stream.update(c.text) + (stream.finish() if c.finish_reason is not None else [])
        return deltas, finish_reason(c.finish_reason, stream.calls)

    def choice(self, index: int, c: CompletionOutput, body: dict, reason: str | None, tokens: int | None = 0) -> dict:
        """Choice `index` with `body` (its text, message or delta), and its tokens from `tokens` on (None: none)."""
        if tokens is None:
            ids, logprobs = [], None
        else:
            ids = c.token_ids[tokens:]
            logprobs = None if c.logprobs is None else self.logprobs(ids, c.logprobs[tokens:len(c.token_ids)])
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": reason,
                **({"token_ids": ids} if self.token_ids else {})}

    def logprobs(self, ids: list[int], per_token: list[dict[int, float]]) -> dict:
        """Each token's logprob and the top `num_top` (the engine's dicts: the sampled token's entry + the top);
        -inf is clamped, as JSON has no infinities."""
        per_token = [{t: max(v, MIN_LOGPROB) for t, v in lp.items()} for lp in per_token]
        top = [sorted(lp.items(), key=lambda kv: -kv[1])[:self.num_top] for lp in per_token]
        text = self.token_text
        if not self.chat:
            return {"tokens": [text(t) for t in ids], "token_logprobs": [lp[t] for t, lp in zip(ids, per_token)],
                    "top_logprobs": [{text(t): v for t, v in best} for best in top]}
        entry = lambda t, v: {"token": text(t), "logprob": v, "bytes": list(text(t).encode())}  # noqa: E731
        return {"content": [{**entry(t, lp[t]), "top_logprobs": [entry(*kv) for kv in best]}
                            for t, lp, best in zip(ids, per_token, top)]}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed whenever the response ends: Starlette cancels a stream whose
    client disconnected but leaves the generator suspended, and closing it is what aborts the engine request."""
    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class Batch:
    """A request's prompts, each its own engine request (so they batch in the engine), read together: `latest`
    holds each one's newest cumulative output. A refusal of any one refuses the request; aclose aborts every
    prompt still running (a refusal, a client gone, the end)."""

    def __init__(self, engine_loop: EngineLoop, parsed: Parsed, metrics: ServerMetrics):
        self.streams = [engine_loop.generate(s, RequestTimer(metrics)) for s in parsed.submissions]
        self.latest: list[RequestOutput | None] = [None] * len(self.streams)
        self.reads: dict[asyncio.Future, int] = {}   # the pending read of each running prompt -> its index
        self.renames, self.batch = parsed.renames, parsed.batch

    async def next(self) -> int | None:
        """The index of a prompt with a newer output (now in `latest`), lowest first; None once every one finished.
        A refusal raises as an APIError (naming the prompt of a batch)."""
        reading = set(self.reads.values())
        for i, stream in enumerate(self.streams):
            if i not in reading and not (self.latest[i] is not None and self.latest[i].finished):
                self.reads[asyncio.ensure_future(anext(stream))] = i
        if not self.reads:
            return None
        done, _ = await asyncio.wait(self.reads, return_when=asyncio.FIRST_COMPLETED)
        read = min(done, key=self.reads.get)
        i = self.reads.pop(read)
        try:
            self.latest[i] = read.result()
        except REFUSALS as e:
            raise refusal(e, self.renames, i if self.batch else None) from None
        return i

    async def started(self) -> None:
        """Until every prompt has an output: each refusal comes before any, so it still gets an HTTP status."""
        while any(out is None for out in self.latest):
            await self.next()

    async def finished(self) -> None:
        while await self.next() is not None:
            pass

    async def aclose(self) -> None:
        for read in self.reads:
            read.cancel()
        await asyncio.gather(*self.reads, return_exceptions=True)
        for stream in self.streams:
            await stream.aclose()


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The JSON body, whole within timeout_s (a client trickling it would hold its handler forever)."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":   # also what makes a browser preflight a cross-origin request
        raise APIError(415, f"Content-Type: must be application/json, got {short(media_type)}",
                       code="unsupported_media_type")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"body: more than {limit:,} bytes (--max-message-bytes)",
                                   code="request_too_large")
    except TimeoutError:
        raise APIError(408, f"body: not received within {timeout_s:g} s (--http-read-timeout)",
                       code="request_timeout") from None
    return b"".join(chunks)


async def unless_disconnected(request: Request, work) -> Response:
    """work's response, unless the client disconnects first: then work is cancelled, which aborts its request.
    (Read the body first: this listens on the same channel.)"""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()
        await asyncio.wait((task,))
    return Response(status_code=499) if task.cancelled() else task.result()   # 499: nginx's "client closed"


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- the app --------------------------------------------------------------------------------------------
class OpenAIApp:
    """The routes over one engine loop; `app` is the ASGI application."""

    def __init__(self, engine_loop: EngineLoop, metrics: ServerMetrics, model_names: tuple[str, ...],
                 api_key: str | None,
                 max_body_bytes: int, read_timeout_s: float, allowed_origins: tuple[str, ...] = (),
                 serve_metrics: bool = True, tool_call_parser: str | None = None):
        """tool_call_parser: how tool_choice auto reads calls (None: as the chat template tells, if it does)."""
        self.engine_loop, self.metrics, self.model_names = engine_loop, metrics, model_names
        self.model_name = model_names[0]   # the one responses give
        self.max_body_bytes, self.read_timeout_s, self.created = max_body_bytes, read_timeout_s, int(time.time())
        self.tokenizer = tok = engine_loop.facts.tokenizer
        self.token_text = functools.cache(lambda t: tok.decode([t]) if tok is not None else f"token_id:{t}")
        self.tool_parser = tool_call_parser or template_parser(None if tok is None else tok.chat_template)
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/detokenize", self.detokenize, methods=["POST"]),
                  Route("/v1/models", self.models), Route("/v1/models/{model:path}", self.model),
                  Route("/version", self.version), Route("/health", self.health),
                  *([Route("/metrics", self.scrape)] if serve_metrics else [])]
        handlers = {APIError: lambda _, e: e.response(), HTTPException: http_error,
                    ClientDisconnect: lambda *_: Response(status_code=499), Exception: internal_error}
        app = Starlette(routes=routes, exception_handlers=handlers)
        app = app if api_key is None else BearerAuth(app, api_key)
        if allowed_origins:   # CORS outside the key check: a preflight carries no Authorization
            app = CORSMiddleware(app, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                                 allow_headers=["authorization", "content-type"])
        self.app = OriginCheck(app, allowed_origins)

    async def completions(self, request: Request) -> Response:
        body = await read_body(request, self.max_body_bytes, self.read_timeout_s)
        return await unless_disconnected(request, self.respond(body, False))

    async def chat_completions(self, request: Request) -> Response:
        body = await read_body(request, self.max_body_bytes, self.read_timeout_s)
        return await unless_disconnected(request, self.respond(body, True))

    async def respond(self, body: bytes, chat: bool) -> Response:
        try:
            parsed = await self.engine_loop.off_engine(self.parse, body, chat)
        except ValueError as e:
            RequestTimer(self.metrics).end(e)
            raise api_error(e, {}) from None
        batch, reply = Batch(self.engine_loop, parsed, self.metrics), Reply(parsed, self.model_name, self.token_text)
        async with contextlib.AsyncExitStack() as closing:
            closing.push_async_callback(batch.aclose)
            await batch.started()   # a refusal gets an HTTP status only before the response starts
            if not parsed.stream:
                await batch.finished()
                return JSONResponse(reply.full(batch.latest))
            closing.pop_all()   # the event stream closes it
        return EventStream(self.events(reply, batch))

    def parse(self, body: bytes, chat: bool) -> Parsed:
        """On the tokenizer thread: the request body checked, converted, chat-templated and tokenized."""
        request = json_object(body)
        renames = field_renames(request, chat)
        try:
            if request.get("model") not in (None, *self.model_names):
                raise self.no_such_model(request["model"])
            if unsupported := [name for name in UNSUPPORTED if request.get(name)]:
                raise APIError(400, f"{unsupported[0]}: not supported by this server", unsupported[0])
            if guided := [name for name in GUIDED_FIELDS if request.get(name) is not None]:
                raise APIError(400, f"{guided[0]}: vLLM's removed guided decoding field; give structured_outputs "
                                    "(or response_format) instead", guided[0])
            if legacy := [name for name in LEGACY_TOOL_FIELDS if request.get(name) is not None]:
                raise APIError(400, f"{legacy[0]}: OpenAI's deprecated function calling; give tools (and tool_choice) "
                                    "instead", legacy[0])
            check_fields(request, ENDPOINT_FIELDS[chat] | set(UNSUPPORTED))
            tools = self.tool_request(request) if chat else None
            params = sampling_params(request, chat, self.engine_loop.facts.sampling_defaults, tools)
            if params.structured_outputs is not None:   # here, so that the engine's thread never compiles one
                self.engine_loop.compile_grammar(params.structured_outputs)
            prompts, batch = (([self.chat_prompt(request, None if tools is None else tools.template_tools)], False)
                              if chat else completion_prompts(request))
            stream, options = flag(request, "stream"), request.get("stream_options") or {}
            if not isinstance(options, dict):
                raise APIError(400, f"stream_options must be an object, got {short(options)}", "stream_options")
            submissions = self.submissions(prompts, params, optional_str(request, "cache_salt"), batch, renames)
            return Parsed(submissions, batch, chat, stream, stream and flag(options, "include_usage"),
                          flag(request, "return_token_ids"), renames, tools, self.tool_parser)
        except ValueError as e:
            raise api_error(e, renames) from None

    def submissions(self, prompts: list, params: SamplingParams, cache_salt: str | None, batch: bool,
                    renames: dict[str, str]) -> list[Submission]:
        """Each prompt tokenized, as the engine takes it; one too long is refused here, before any of them runs."""
        if len(prompts) > (most := self.engine_loop.max_waiting):   # more could never be admitted together
            raise APIError(400, f"prompt: at most {most:,} prompts per request (--max-waiting), got {len(prompts):,}",
                           "prompt")
        submissions = []
        for i, prompt in enumerate(prompts):
            try:
                ids = self.engine_loop.prompt_ids(prompt)
                if isinstance(counted := prompt if ids is None else ids, list):
                    self.engine_loop.facts.check_prompt_length(len(counted))
                submissions.append(Submission(prompt, ids, params, cache_salt=cache_salt))
            except ValueError as e:
                raise refusal(e, renames, i if batch else None) from None
        return submissions

    def tool_request(self, request: dict) -> ToolRequest | None:
        """The request's tool fields, checked; None when no call can come (no tools, or tool_choice "none")."""
        try:
            tools = check_tools(request.get("tools"), request.get("tool_choice"), request.get("parallel_tool_calls"))
        except ValueError as e:
            raise field_error(e) from None
        if tools.choice == "auto" and self.tool_parser is None:   # vLLM refuses it too: calls would come as text
            raise APIError(400, "tool_choice: 'auto' (the default with tools) needs a tool-call parser, and this "
                                "model's chat template tells none; start the server with --tool-call-parser (hermes or "
                                "llama3_json), or ask for tool_choice 'required' or a named function", "tool_choice")
        return None if tools.choice == "none" else tools

    def chat_prompt(self, request: dict, tools: list[dict] | None = None) -> str:
        """The messages through the model's chat template, showing it `tools`."""
        try:
            messages = chat_messages(request.get("messages"))
        except ValueError as e:
            raise field_error(e) from None
        if self.tokenizer is None:
            raise APIError(400, "messages: this model has no tokenizer, so no chat template; use /v1/completions "
                                "with a prompt of token ids", "messages")
        try:
            return apply_chat_template(self.tokenizer, messages, tools=tools)
        except TemplateError as e:   # the template's own checks, e.g. roles that must alternate
            raise APIError(400, f"messages: {e}", "messages") from None
        except ValueError as e:      # a model without a chat template
            raise field_error(e) from None

    async def events(self, reply: Reply, batch: Batch) -> AsyncIterator[str]:
        """The stream's events, each prompt's first outputs in order, then as they come; a refusal or failure after
        the response started is an error event."""
        async with contextlib.aclosing(batch):
            try:
                for i, out in enumerate(batch.latest):
                    for chunk in reply.chunks(i, out):
                        yield sse(chunk)
                while (i := await batch.next()) is not None:
                    for chunk in reply.chunks(i, batch.latest[i]):
                        yield sse(chunk)
                if reply.include_usage:
                    yield sse(reply.usage_chunk(batch.latest))
            except APIError as e:
                yield sse(e.body())
        yield "data: [DONE]\n\n"

    def no_such_model(self, name) -> APIError:
        served = " or ".join(map(repr, self.model_names))
        return APIError(404, f"model {short(name)} does not exist; this server serves {served}", "model",
                        "model_not_found")

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "jaxserve",
                "max_model_len": self.engine_loop.facts.cfg.max_model_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card(name) for name in self.model_names]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] not in self.model_names:
            raise self.no_such_model(request.path_params["model"])
        return JSONResponse(self.model_card(request.path_params["model"]))

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": jaxserve.__version__})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt, or messages through the chat template, as the engine tokenizes them."""
        body = await read_body(request, self.max_body_bytes, self.read_timeout_s)
        return JSONResponse(await self.engine_loop.off_engine(self.token_ids_of, body))

    def token_ids_of(self, body: bytes) -> dict:
        request = json_object(body)
        check_fields(request, TOKENIZE_FIELDS)
        if self.tokenizer is None:
            raise APIError(400, "prompt: this model has no tokenizer", "prompt")
        if "messages" in request:
            text, special = self.chat_prompt(request), False   # the template writes the special tokens
        elif isinstance(request.get("prompt"), str):
            text, special = request["prompt"], flag(request, "add_special_tokens")
        else:
            raise APIError(400, "prompt must be a string (or give messages)", "prompt")
        try:
            ids = self.engine_loop.facts.tokenize(text, add_special_tokens=special)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        return {"count": len(ids), "max_model_len": self.engine_loop.facts.cfg.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request) -> Response:
        body = await read_body(request, self.max_body_bytes, self.read_timeout_s)
        return JSONResponse(await self.engine_loop.off_engine(self.text_of, body))

    def text_of(self, body: bytes) -> dict:
        request = json_object(body)
        check_fields(request, {"model", "tokens"})
        if self.tokenizer is None:
            raise APIError(400, "tokens: this model has no tokenizer", "tokens")
        facts = self.engine_loop.facts
        ids = token_list(request, "tokens", facts.model_config.vocab_size, facts.cfg.max_model_len)
        return {"prompt": self.tokenizer.decode(ids)}

    async def health(self, request: Request) -> Response:
        failure = self.engine_loop.failure
        return Response(status_code=200) if failure is None else APIError(503, str(failure)).response()

    async def scrape(self, request: Request) -> Response:
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)


def http_error(request: Request, error: HTTPException) -> Response:
    """Starlette's own refusals (unknown route, wrong method) in OpenAI's shape."""
    return APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}").response()


def internal_error(request: Request, error: Exception) -> Response:
    return APIError(500, f"internal error: {type(error).__name__}").response()


class BearerAuth:
    """401 unless a request carries `Authorization: Bearer <key>`; /health stays open to probes."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            if not bearer_matches(Headers(scope=scope).get("authorization"), self.key):
                response = APIError(401, "Authorization: Bearer <api key> missing or wrong", code="invalid_api_key")
                return await response.response()(scope, receive, send)
        await self.app(scope, receive, send)


class OriginCheck:
    """403 for a browser's request from an origin not in allowed_origins ("*": any): a web page must not drive a
    server on the user's machine. Browsers send Origin on every cross-origin request and every POST; other
    clients send none."""

    def __init__(self, app, allowed_origins: tuple[str, ...]):
        self.app, self.allowed = app, frozenset(allowed_origins)

    async def __call__(self, scope, receive, send) -> None:
        origin = Headers(scope=scope).get("origin") if scope["type"] == "http" else None
        if origin is not None and "*" not in self.allowed and origin not in self.allowed:
            response = APIError(403, f"Origin {short(origin)} is not allowed (--allowed-origins)",
                                code="origin_not_allowed")
            return await response.response()(scope, receive, send)
        await self.app(scope, receive, send)


# ---- the server ----------------------------------------------------------------------------------------
class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn that leaves signals alone: `jaxserve serve` drains both front ends on SIGTERM itself."""

    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    """uvicorn serving an ASGI app in the running event loop (beside grpc.aio), under ConnectionLimits."""

    def __init__(self, app, host: str, port: int, grace_period_s: float, limits: ConnectionLimits):
        self.host, self.port = host, port
        self.uvicorn = EmbeddedUvicorn(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                                      timeout_graceful_shutdown=grace_period_s,
                                                      timeout_keep_alive=limits.read_timeout_s,
                                                      http=guarded_protocol(limits)))
        self.task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind and serve; the bound port (port 0 picks a free one)."""
        quiet_accept_failures(asyncio.get_running_loop())
        family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((self.host, self.port), family=family)
        # Accepted sockets inherit this; asyncio sets it only where proto is IPPROTO_TCP and create_server leaves
        # 0, so without it Nagle holds each event behind the previous write until the client's delayed ACK (40 ms).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self.task = asyncio.create_task(self.uvicorn.serve(sockets=[sock]))
        while not self.uvicorn.started:   # startup is one step; a failure ends the task
            if self.task.done():
                self.task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return sock.getsockname()[1]

    async def stop(self) -> None:
        """Stop accepting; in-flight responses get the grace period, then are cancelled (aborting their requests)."""
        self.uvicorn.should_exit = True
        if self.task is not None:
            await self.task
