"""OpenAI tool calling on /v1/chat/completions, as vLLM and SGLang serve it; pure Python, no engine or network.

`check_tools` validates a request's `tools`, `tool_choice` and `parallel_tool_calls` into a ToolRequest. With
tool_choice "required" or a named function the whole output is constrained (`constraint_schema`) to a JSON array of
calls, `[{"name": ..., "arguments": {...}}, ...]`, as vLLM does; with "auto" the model writes calls in its own format,
read back by a parser: "hermes" (Hermes, Qwen: `<tool_call>{...}</tool_call>` blocks) or "llama3_json" (Llama 3.x: a
JSON object, optionally after `<|python_tag|>`, several separated by ";"), which `template_parser` tells from a chat
template. `parse_tool_calls` reads a whole output into (content, calls); `ToolCallStream` turns cumulative outputs
into chat-completion-chunk deltas that add up to the same. A call naming an undeclared function, or whose JSON does not parse, stays content, unchanged (vLLM's rule), as
does all text around the calls but the whitespace next to them. `chat_messages` readies OpenAI messages (tool calls
and tool results among them) for a chat template, `ToolRequest.template_tools` its `tools`."""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field

from jaxserve.engine.sampling_params import MAX_STRUCTURED_CHARS, short

MAX_TOOLS = 128
MAX_SCHEMA_CHARS = MAX_STRUCTURED_CHARS   # a schema's compact JSON, as the grammar compiler bounds its constraints
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
FORCED = ("required", "function")         # the choices that constrain the output to a call array
TOOL_PARSERS = ("hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ID_CHARS = string.ascii_letters + string.digits
WHITESPACE = re.compile(r"\s*")           # str.isspace's whitespace


def reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")   # json.loads takes NaN and Infinity; clients' parsers don't


DECODER = json.JSONDecoder(parse_constant=reject_constant)


@dataclass(slots=True)
class ToolRequest:
    tools: list[dict]                 # the request's tools, only the fields OpenAI defines
    parameters: dict[str, dict]       # function name -> its arguments' schema, ready for constraint_schema's $defs
    choice: str                       # "none" | "auto" | "required" | "function" (then `function` names it)
    function: str | None
    parallel: bool

    @property
    def allowed(self) -> tuple[str, ...]:
        """The functions the model may call."""
        return tuple(self.parameters) if self.function is None else (self.function,)

    @property
    def template_tools(self) -> list[dict] | None:
        """The chat template's `tools`: none under tool_choice "none", where a call would only come back as text
        (vLLM's --exclude-tools-when-tool-choice-none)."""
        return self.tools if self.choice != "none" else None


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str   # JSON text of an object, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + "".join(secrets.choice(ID_CHARS) for _ in range(24)))

    def message(self) -> dict:
        """The call as an assistant message's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def template_parser(chat_template: str | dict | None) -> str | None:
    """The parser of the calls a chat template teaches its model to write, told by the markers the template writes
    (None: neither, e.g. a template that shows no tools); a tokenizer's dict of named templates counts them all."""
    text = " ".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template or ""
    return "hermes" if HERMES_OPEN in text else "llama3_json" if PYTHON_TAG in text else None


# ---- the request ------------------------------------------------------------------------------------------
def check_tools(tools, tool_choice, parallel_tool_calls) -> ToolRequest:
    """The request's tool fields, validated; tool_choice defaults as OpenAI's (auto with tools, else none), an empty
    tools list is none given (vLLM takes it too)."""
    tools = [] if tools is None else tools
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of function tools, got {short(tools)}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    checked, parameters = [], {}
    for i, tool in enumerate(tools):
        checked.append(check_tool(tool, f"tools[{i}]"))
        name = checked[-1]["function"]["name"]
        if name in parameters:
            raise ValueError(f"tools[{i}].function.name: {name!r} is declared twice")
        parameters[name] = arguments_schema(checked[-1]["function"].get("parameters"), name, i)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls must be a bool, got {short(parallel_tool_calls)}")
    req = ToolRequest(checked, parameters, *check_choice(tool_choice, parameters), parallel_tool_calls is not False)
    if req.choice in FORCED and (n := json_chars(constraint_schema(req))) > MAX_SCHEMA_CHARS:
        raise ValueError(f"tool_choice: the tools' schemas constrain the output with {n:,} characters of JSON; at most "
                         f"{MAX_SCHEMA_CHARS:,}")
    return req


def check_tool(tool, where: str) -> dict:
    """One tool as {"type": "function", "function": {...}}, keeping only OpenAI's fields."""
    if not isinstance(tool, dict):
        raise ValueError(f"{where} must be an object, got {short(tool)}")
    if tool.get("type") != "function":
        raise ValueError(f"{where}.type must be 'function', got {short(tool.get('type'))}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ValueError(f"{where}.function must be an object, got {short(fn)}")
    if not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
        raise ValueError(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {short(fn.get('name'))}")
    for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema (an object)"),
                            ("strict", bool, "a bool")):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            raise ValueError(f"{where}.function.{key} must be {what}, got {short(fn[key])}")
    if (params := fn.get("parameters")) is not None:
        if params.get("type", "object") != "object":   # arguments are an object, in every format
            raise ValueError(f"{where}.function.parameters: type must be 'object', got {short(params['type'])}")
        if (n := json_chars(params)) > MAX_SCHEMA_CHARS:
            raise ValueError(f"{where}.function.parameters: {n:,} characters of JSON; at most {MAX_SCHEMA_CHARS:,}")
    return {"type": "function",
            "function": {k: fn[k] for k in ("name", "description", "parameters", "strict") if fn.get(k) is not None}}


def check_choice(choice, names) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if choice in CHOICES:
        if choice != "none" and not names:
            raise ValueError(f"tool_choice: {choice!r} needs tools")
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        if fn["name"] not in names:
            raise ValueError(f"tool_choice.function.name: {fn['name']!r} is not one of tools")
        return "function", fn["name"]
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                     f"{{\"name\": ...}}}}, got {short(choice)}")


def json_chars(schema) -> int:
    """Its length as the grammar compiler's cache key measures it."""
    return len(json.dumps(schema, sort_keys=True, separators=(",", ":")))


def arguments_schema(params: dict | None, name: str, index: int) -> dict:
    """The function's parameters as constraint_schema's $defs[name]: an object (when the schema leaves the type
    open), its local $refs rebased there ("#/$defs/X" -> "#/$defs/name/$defs/X"), its $schema dropped (a dialect
    is declared at a document's root only)."""
    params = {k: v for k, v in (params or {}).items() if k != "$schema"}
    try:
        return rebase({"type": "object", **params}, f"#/$defs/{name}")
    except RecursionError:
        raise ValueError(f"tools[{index}].function.parameters: nested too deeply") from None


def rebase(schema, root: str):
    if isinstance(schema, list):
        return [rebase(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: root + v[1:] if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/"))
            else rebase(v, root) for k, v in schema.items()}


def constraint_schema(req: ToolRequest) -> dict | None:
    """The JSON schema the whole output keeps to under tool_choice "required" or a named function (None under auto
    and none): an array of at least one call (at most one without parallel_tool_calls), each
    {"name": an allowed function, "arguments": its parameters}."""
    if req.choice not in FORCED:
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{name}"}},
              "required": ["name", "arguments"], "additionalProperties": False} for name in req.allowed]
    return {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1,
            **({} if req.parallel else {"maxItems": 1}), "$defs": {name: req.parameters[name] for name in req.allowed}}


# ---- the output -------------------------------------------------------------------------------------------
def parse_tool_calls(text: str, req: ToolRequest, parser: str | None) -> tuple[str, list[ToolCall]]:
    """A whole output as (content, calls): read as the constrained call array under "required" or a named function,
    in `parser`'s format under auto (the only choice that needs one), as plain content under none."""
    content, found = scan(text, req, parser, final=True)
    return content, [ToolCall(name, arguments) for name, arguments in found]


def finish_reason(engine_reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's "tool_calls" for an output that stopped after calling tools; the engine's reason otherwise ("length"
    stays: the client should know the output was cut)."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


@dataclass(slots=True)
class ToolCallStream:
    """A streamed choice's deltas: `update` with each cumulative output text, `finish` after the last. Text is sent
    as content as soon as it cannot be part of a call; a call goes once whole (its JSON has to parse, and name a
    declared function, before it is a call at all): its id and name, then its arguments. All the content deltas
    and calls add up to what parse_tool_calls makes of the final text."""
    req: ToolRequest
    parser: str | None
    calls: list[ToolCall] = field(default_factory=list)   # those sent
    text: str = ""
    sent: int = 0                                         # characters of content sent

    def update(self, text: str) -> list[dict]:
        self.text = text
        return self.deltas(*scan(text, self.req, self.parser, final=False))

    def finish(self) -> list[dict]:
        return self.deltas(*scan(self.text, self.req, self.parser, final=True))

    def deltas(self, content: str, found: list[tuple[str, str]]) -> list[dict]:
        out = [{"content": content[self.sent:]}] if len(content) > self.sent else []
        self.sent = len(content)
        for name, arguments in found[len(self.calls):]:
            call, i = ToolCall(name, arguments), len(self.calls)
            self.calls.append(call)
            out += [{"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                     "function": {"name": name, "arguments": ""}}]},
                    {"tool_calls": [{"index": i, "function": {"arguments": arguments}}]}]
        return out


def scan(text: str, req: ToolRequest, parser: str | None, final: bool) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of an output. Not final: only what no continuation of the text can change,
    content up to there and the calls before it; what parsing all of any longer text gives begins with that."""
    if req.choice == "none":
        return text, []
    if req.choice in FORCED:
        return scan_objects(text, req, final, "[", ",", "]")
    if parser == "hermes":
        return scan_hermes(text, req, final)
    if parser == "llama3_json":
        return scan_objects(text, req, final, PYTHON_TAG, ";", "")
    raise ValueError(f"parser must be one of {', '.join(TOOL_PARSERS)}, got {short(parser)}")


def scan_hermes(text: str, req: ToolRequest, final: bool) -> tuple[str, list[tuple[str, str]]]:
    """<tool_call> JSON </tool_call> blocks anywhere in the text; a last one left open is a call too when final (as
    vLLM reads it: the output may stop before the closing tag)."""
    content, found, pos = [], [], 0
    while (start := text.find(HERMES_OPEN, pos)) >= 0:
        before = back_over_ws(text, pos, start)
        close = text.find(HERMES_CLOSE, start + len(HERMES_OPEN))
        if close < 0 and not final:
            content.append(text[pos:before])
            return "".join(content), found
        if close < 0:   # final: a block left open runs to the end
            close = end = len(text)
        else:
            end = close + len(HERMES_CLOSE)
        call = as_call(decoded(text[start + len(HERMES_OPEN):close]), req)
        if call is None:
            content.append(text[pos:end])
            pos = end
        else:
            content.append(text[pos:before])
            found.append(call)
            pos = skip_ws(text, end)
    content.append(text[pos:] if final else text[pos:undecided_tail(text, pos, HERMES_OPEN)])
    return "".join(content), found


def undecided_tail(text: str, pos: int, marker: str) -> int:
    """Where the end of text[pos:] that may yet open a call starts: a beginning of marker, with the whitespace
    before it."""
    cut = next((i for i in range(max(pos, len(text) - len(marker) + 1), len(text)) if marker.startswith(text[i:])),
               len(text))
    return back_over_ws(text, pos, cut)


def back_over_ws(text: str, start: int, end: int) -> int:
    """Where the whitespace ending text[start:end] starts (walked back: the text may be long, the run is short)."""
    while end > start and text[end - 1].isspace():
        end -= 1
    return end


def scan_objects(text: str, req: ToolRequest, final: bool, opener: str, sep: str,
                 closer: str) -> tuple[str, list[tuple[str, str]]]:
    """An output that is JSON call objects: [opener] call (sep call)* [closer], whitespace between; with a closer
    (an array) the opener is required. From the first object that is not a call on, the text is content (all of
    it when that is the first); so is any text after the closer."""
    pos = skip_ws(text, 0)
    if text.startswith(opener, pos):
        pos = skip_ws(text, pos + len(opener))
    elif not final and opener.startswith(text[pos:]):
        return "", []
    elif closer:
        return text, []
    found, start = [], 0
    while pos < len(text):
        try:
            value, end = DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError):
            if not final and text[pos] == "{":   # may be a call still being written
                return "", found
            value = None
        if (call := as_call(value, req)) is None:
            return text[start:], found
        found.append(call)
        pos = skip_ws(text, end)
        if closer and text.startswith(closer, pos):
            return text[skip_ws(text, pos + len(closer)):], found
        if text.startswith(sep, pos):
            pos = skip_ws(text, pos + len(sep))
        elif pos < len(text):
            return text[pos:], found
        start = pos
    return (text[start:] if final else ""), found


def skip_ws(text: str, pos: int) -> int:
    return WHITESPACE.match(text, pos).end()


def decoded(text: str):
    try:
        return DECODER.decode(text)
    except (ValueError, RecursionError):
        return None


def as_call(value, req: ToolRequest) -> tuple[str, str] | None:
    """(name, arguments JSON) of {"name": an allowed function, "arguments" (Llama: "parameters"): {...}}; arguments
    left out are none."""
    if not isinstance(value, dict) or value.get("name") not in req.allowed:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return (value["name"], arguments_text(arguments)) if isinstance(arguments, dict) else None


def arguments_text(arguments: dict) -> str:
    """JSON text with non-ASCII as is, but escaped where the model wrote a lone surrogate ("\\ud800"): UTF-8, which
    the response is, can't carry one."""
    text = json.dumps(arguments, ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(arguments)
    return text


# ---- the conversation -------------------------------------------------------------------------------------
def chat_messages(messages) -> list[dict]:
    """OpenAI chat messages as chat templates take them (transformers' convention): content as text (text parts
    joined, none as ""), an assistant's tool_calls with their arguments parsed into objects, a tool message's
    tool_call_id with the name of the function whose call it answers."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{role, content}}, got {short(messages)}")
    out, called = [], {}   # call id -> function name, of the calls so far
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string role, got {short(message)}")
        converted = {"role": message["role"], "content": message_text(message.get("content"), f"messages[{i}]")}
        if message["role"] == "assistant" and message.get("tool_calls") is not None:
            converted["tool_calls"] = template_calls(message["tool_calls"], f"messages[{i}].tool_calls")
            called.update((c["id"], c["function"]["name"]) for c in converted["tool_calls"])
        if message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ValueError(f"messages[{i}].tool_call_id must be a string, got {short(call_id)}")
            if call_id not in called:   # OpenAI's rule too: a tool result answers a call before it
                raise ValueError(f"messages[{i}].tool_call_id: {call_id!r} is no earlier assistant tool call's id")
            converted |= {"tool_call_id": call_id, "name": called[call_id]}
        out.append(converted)
    return out


def message_text(content, where: str) -> str:
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(p.get("text", "")) for p in content)
    if content is not None and not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or text parts, got {short(content)}")
    return content or ""


def template_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list, got {short(calls)}")
    return [template_call(call, f"{where}[{j}]") for j, call in enumerate(calls)]


def template_call(call, where: str) -> dict:
    """{"id", "type": "function", "function": {"name", "arguments": an object}}; arguments come as JSON text from
    OpenAI clients (an object is taken too, as some others send it)."""
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise ValueError(f"{where} must be a function call object, got {short(call)}")
    if not isinstance(call.get("id"), str):
        raise ValueError(f"{where}.id must be a string, got {short(call.get('id'))}")
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}.function must be an object with a string name, got {short(fn)}")
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = DECODER.decode(arguments)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{where}.function.arguments: not valid JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object, got {short(fn.get('arguments'))}")
    return {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": arguments}}
