"""Tool calling's pure-Python part (jaxserve/serve/tool_calls.py): request validation, the constraint schema (through
jsonschema and the engine's grammar compiler), the hermes and llama3_json parsers on realistic outputs, streaming
adding up to the whole-output parse (hypothesis), and messages through the embedded model's chat template and a
Hermes-style one."""
import json
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.sampling_params import StructuredOutputsParams
from jaxserve.engine.structured_outputs import StructuredOutputs
from jaxserve.models import gguf
from jaxserve.models.loader import DEFAULT_MODEL, embedded_model_path
from jaxserve.serve.tool_calls import (MAX_TOOLS, ToolCall, ToolCallStream, chat_messages, check_tools,
                                       constraint_schema, finish_reason, parse_tool_calls)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
                   "required": ["city"], "additionalProperties": False,
                   "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"$schema": "https://json-schema.org/draft/2020-12/schema",
                                       "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, TIME, PING]
AUTO = check_tools(TOOLS, None, None)


def tool(name: str = "f", **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed[1]]


# ---- check_tools ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tools, choice, parallel, error", [
    ("get_weather", None, None, "tools must be a list"),
    ([PING] * (MAX_TOOLS + 1), None, None, "tools: at most 128"),
    ([WEATHER, 5], None, None, "tools[1] must be an object"),
    ([{"type": "retrieval"}], None, None, "tools[0].type must be 'function'"),
    ([{"type": "function"}], None, None, "tools[0].function must be an object"),
    ([tool("get weather")], None, None, "tools[0].function.name must match"),
    ([tool("x" * 65)], None, None, "tools[0].function.name must match"),
    ([tool(None)], None, None, "tools[0].function.name must match"),
    ([WEATHER, tool(description=3)], None, None, "tools[1].function.description must be a string"),
    ([tool(parameters="{}")], None, None, "tools[0].function.parameters must be a JSON schema"),
    ([tool(parameters={"type": "string"})], None, None, "tools[0].function.parameters: type must be 'object'"),
    ([PING, tool(parameters={"type": "object", "description": "x" * 70_000})], None, None,
     "tools[1].function.parameters: 70,"),
    ([tool(strict="yes")], None, None, "tools[0].function.strict must be a bool"),
    ([WEATHER, PING, WEATHER], None, None, "tools[2].function.name: 'get_weather' is declared twice"),
    (TOOLS, "sometimes", None, "tool_choice must be 'none', 'auto', 'required' or"),
    (TOOLS, {"type": "function"}, None, "tool_choice must be"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice.function.name: 'nope' is not"),
    (None, "required", None, "tool_choice: 'required' needs tools"),
    ([], "auto", None, "tool_choice: 'auto' needs tools"),
    (TOOLS, None, "yes", "parallel_tool_calls must be a bool"),
    ([tool(f"f{i}", parameters={"type": "object", "description": "x" * 600}) for i in range(MAX_TOOLS)],
     "required", None, "tool_choice: the tools' schemas constrain the output with"),
])
def test_check_tools_errors_name_their_field(tools, choice, parallel, error):
    with pytest.raises(ValueError, match="^" + re.escape(error)):
        check_tools(tools, choice, parallel)


def test_deeply_nested_parameters_refused_by_name():
    schema = leaf = {"type": "object", "properties": {}}
    for _ in range(700):
        leaf["properties"]["a"] = leaf = {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.parameters: nested too deeply"):
        check_tools([tool(parameters=schema)], None, None)


def test_check_tools_defaults_as_openai():
    assert (AUTO.choice, AUTO.function, AUTO.parallel, AUTO.allowed) == \
           ("auto", None, True, ("get_weather", "get_time", "ping"))
    assert AUTO.template_tools == TOOLS
    for tools in (None, []):
        req = check_tools(tools, None, None)
        assert (req.choice, req.template_tools, constraint_schema(req)) == ("none", None, None)
    named = check_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False)
    assert (named.choice, named.function, named.parallel, named.allowed) == ("function", "get_time", False,
                                                                            ("get_time",))
    assert check_tools(TOOLS, "none", None).template_tools is None   # no calls to make: none shown
    # the template gets OpenAI's fields only
    assert check_tools([{**tool(description="d", extra=1), "x": 2}], None, None).tools == [tool(description="d")]


# ---- constraint_schema ------------------------------------------------------------------------------------
def array(*calls) -> list[dict]:
    return [{"name": name, "arguments": arguments} for name, arguments in calls]


GOOD = array(("get_weather", {"city": "Paris", "unit": "celsius"}))
GOOD_TWO = array(("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"}), ("ping", {}))
BAD = [[], array(("get_weather", {"unit": "celsius"})),               # a required argument left out
       array(("get_weather", {"city": "Paris", "unit": "kelvin"})),   # through the $ref to its $defs
       array(("get_weather", {"city": "Paris", "when": "now"})),      # additionalProperties
       array(("get_time", {"tz": 1})), array(("get_time", "tz=CET")),  # arguments an object, typed
       array(("ping", [])), array(("unknown", {})), [{"name": "ping"}],
       [{"name": "ping", "arguments": {}, "id": "x"}], {"name": "ping", "arguments": {}}]


def test_constraint_schema_required():
    schema = constraint_schema(check_tools(TOOLS, "required", None))
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(GOOD) and validator.is_valid(GOOD_TWO)
    assert [b for b in BAD if validator.is_valid(b)] == []
    one = jsonschema.Draft202012Validator(constraint_schema(check_tools(TOOLS, "required", False)))
    assert one.is_valid(GOOD) and not one.is_valid(GOOD_TWO)


def test_constraint_schema_named_function():
    schema = constraint_schema(check_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None))
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(GOOD) and validator.is_valid(GOOD + GOOD)
    assert not validator.is_valid(array(("get_time", {"tz": "CET"})))
    assert [b for b in BAD if validator.is_valid(b)] == []
    assert list(schema["$defs"]) == ["get_weather"]


def test_constraint_schema_rebases_local_refs():
    recursive = {"type": "object", "properties": {"name": {"type": "string"}, "kids": {
        "type": "array", "items": {"$ref": "#"}}}, "required": ["name"]}
    legacy = {"type": "object", "properties": {"p": {"$ref": "#/definitions/P"}},
              "definitions": {"P": {"type": "integer"}}}
    validator = jsonschema.Draft202012Validator(constraint_schema(check_tools(
        [tool("tree", parameters=recursive), tool("legacy", parameters=legacy)], "required", None)))
    assert validator.is_valid(array(("tree", {"name": "a", "kids": [{"name": "b", "kids": []}]}), ("legacy", {"p": 1})))
    assert not validator.is_valid(array(("tree", {"name": "a", "kids": [{"kids": []}]})))
    assert not validator.is_valid(array(("legacy", {"p": "one"})))


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer (its GGUF vocabulary and chat template), without the model."""
    path = embedded_model_path(DEFAULT_MODEL)
    return gguf.gguf_tokenizer(gguf.open_gguf(path), path)


def test_constraint_compiles_in_the_engine_grammar(tokenizer):
    """llguidance (the engine's constraint compiler, compact JSON) takes the schema: a right call array reads to
    the end, a call to an undeclared function or with a wrong argument does not; and the output parses back."""
    req = check_tools(TOOLS, "required", None)
    outputs = StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id])

    def accepted(text: str) -> bool:
        matcher, ids = outputs.matcher(StructuredOutputsParams(json=constraint_schema(req))), tokenizer.encode(text)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    text = json.dumps(GOOD_TWO)
    assert accepted(text) and accepted(json.dumps(GOOD))
    assert not accepted(json.dumps(array(("unknown", {})))) and not accepted(json.dumps(BAD[2]))
    assert calls_of(parse_tool_calls(text, req, "hermes")) == [(c["name"], c["arguments"]) for c in GOOD_TWO]


def test_parse_constrained_output():
    req = check_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)
    content, calls = parse_tool_calls('[{"name": "get_time", "arguments": {"tz": "CET"}}]', req, "llama3_json")
    assert content == "" and calls_of((content, calls)) == [("get_time", {"tz": "CET"})]
    # cut off by max_tokens: the calls whole by then, the rest as content
    cut = '[{"name": "get_time", "arguments": {"tz": "CET"}}, {"name": "get_time", "argu'
    assert parse_tool_calls(cut, req, "hermes")[0] == '{"name": "get_time", "argu'
    assert calls_of(parse_tool_calls(cut, req, "hermes")) == [("get_time", {"tz": "CET"})]
    assert parse_tool_calls('[{"name": "get_ti', req, "hermes")[0] == '[{"name": "get_ti'


# ---- parsers ----------------------------------------------------------------------------------------------
def hermes(name: str, arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


PARIS = ("get_weather", {"city": "Paris"})
CET = ("get_time", {"tz": "CET"})
HERMES_CASES = [
    (hermes(*PARIS), "", [PARIS]),
    (hermes(*PARIS) + "\n" + hermes(*CET) + "\n" + hermes("ping", {}), "", [PARIS, CET, ("ping", {})]),
    ("I'll check the weather first.\n\n" + hermes(*PARIS), "I'll check the weather first.", [PARIS]),
    ("The weather in Paris is sunny, 21 °C.", "The weather in Paris is sunny, 21 °C.", []),
    (hermes("send_email", {"to": "x"}), hermes("send_email", {"to": "x"}), []),            # undeclared: content
    (hermes(*PARIS) + "\n" + hermes("rm", {}), hermes("rm", {}), [PARIS]),                  # only that one
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # a brace short
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', []),
    ("<tool_call>\n{'name': 'ping'}\n</tool_call>", "<tool_call>\n{'name': 'ping'}\n</tool_call>", []),
    ('<tool_call>\n{"name": "ping", "arguments": [1]}\n</tool_call>',
     '<tool_call>\n{"name": "ping", "arguments": [1]}\n</tool_call>', []),
    ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n', "", [CET]),      # stopped before </...>
    ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "CE', '<tool_call>\n{"name": "get_time", "arguments": '
                                                                 '{"tz": "CE', []),
    (hermes(*PARIS) + "\nDone.", "Done.", [PARIS]),
    ("Use the <tool_call> tag.", "Use the <tool_call> tag.", []),
    ('<tool_call>{"name": "ping"}</tool_call>', "", [("ping", {})]),                        # no arguments: none
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>', "",
     [("get_weather", {"city": "Zürich"})]),
]
LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [PARIS]),
    ('\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"tz": "CET"}}',
     "", [PARIS, CET]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}\nLet me know if you need more.',
     "Let me know if you need more.", [PARIS]),
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ('{"name": "book_flight", "parameters": {"to": "Paris"}}', '{"name": "book_flight", "parameters": {"to": "Paris"}}',
     []),
    ('{"name": "get_weather", "parameters": {"city": "Paris"', '{"name": "get_weather", "parameters": {"city": "Paris"',
     []),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "nope"}', '{"name": "nope"}', [PARIS]),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "ping", "parameters": {"x": NaN}}', '{"name": "ping", "parameters": {"x": NaN}}', []),
    ("<|python_tag|>", "<|python_tag|>", []),
]


@pytest.mark.parametrize("parser, text, content, calls", [("hermes", *c) for c in HERMES_CASES] +
                         [("llama3_json", *c) for c in LLAMA_CASES])
def test_parsers_on_model_outputs(parser, text, content, calls):
    parsed = parse_tool_calls(text, AUTO, parser)
    assert (parsed[0], calls_of(parsed)) == (content, calls)
    assert parse_tool_calls(text, check_tools(TOOLS, "none", None), parser) == (text, [])   # none: all content


def test_arguments_text_and_ids():
    (call,) = parse_tool_calls(hermes("get_weather", {"city": "Zürich"}), AUTO, "hermes")[1]
    assert call.arguments == '{"city": "Zürich"}'                                # JSON text, as OpenAI sends it
    assert call.message() == {"id": call.id, "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
    (call,) = parse_tool_calls('<tool_call>{"name": "ping", "arguments": {"s": "\\ud800"}}</tool_call>', AUTO,
                               "hermes")[1]
    assert call.arguments == '{"s": "\\ud800"}'                                  # UTF-8 can't carry it raw
    ids = {ToolCall("ping", "{}").id for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


def test_unknown_parser_refused():
    with pytest.raises(ValueError, match="^parser must be one of hermes, llama3_json"):
        parse_tool_calls("hi", AUTO, "mistral")


def test_finish_reason():
    call = [ToolCall("ping", "{}")]
    assert [finish_reason("stop", call), finish_reason("length", call), finish_reason("stop", []),
            finish_reason(None, [])] == ["tool_calls", "length", "stop", None]


# ---- streaming --------------------------------------------------------------------------------------------
def stream(text: str, req, parser: str, cuts) -> tuple[str, list[ToolCall], list[dict]]:
    """The stream's deltas over text's prefixes ending at cuts, then the whole, then finish; the content and calls
    they add up to (each call's name first, then its arguments, as OpenAI streams them)."""
    s = ToolCallStream(req, parser)
    deltas = [d for cut in [*sorted(cuts), len(text)] for d in s.update(text[:cut])] + s.finish()
    content, calls = "", []
    for delta in deltas:
        assert len(delta) == 1
        content += delta.get("content", "")
        for part in delta.get("tool_calls", []):
            if "id" in part:
                assert part["index"] == len(calls) and part["type"] == "function"
                assert part["function"]["arguments"] == ""
                calls.append(ToolCall(part["function"]["name"], "", part["id"]))
            else:
                assert part["index"] == len(calls) - 1 and calls[-1].arguments == ""
                calls[-1].arguments = part["function"]["arguments"]
    assert calls == s.calls
    return content, calls, deltas


PIECES = st.sampled_from([
    hermes(*PARIS), hermes(*CET), hermes("nope", {}), "<tool_call>", "</tool_call>", "<tool_", "call>", "\n", " ",
    '{"name": "get_weather", "parameters": {"city": "Paris"}}', '{"name": "get_time", "arguments": {"tz": "CET"}}',
    '{"name": "ping"}', '{"name": "nope", "arguments": {}}', '{"name": "get_weather", "arguments": {"city": ', "}",
    "{", "[", "]", ",", ";", ", ", "<|python_tag|>", "<|python", "Sure!", "Hello world", "é ü 日本", '"'])
TEXTS = st.lists(PIECES | st.text(st.sampled_from(' \n\t{}[]<>;,:"/|_abnmeplt'), max_size=6), max_size=8).map("".join)
REQUESTS = st.sampled_from([AUTO, check_tools(TOOLS, "required", None), check_tools(TOOLS, "none", None),
                            check_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)])


@settings(max_examples=600, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(0, 400), max_size=12), req=REQUESTS,
       parser=st.sampled_from(["hermes", "llama3_json"]))
def test_stream_adds_up_to_the_whole_parse(text, cuts, req, parser):
    content, calls, _ = stream(text, req, parser, [c for c in cuts if c <= len(text)])
    whole = parse_tool_calls(text, req, parser)
    assert content == whole[0]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole[1]]


@pytest.mark.parametrize("parser, text", [("hermes", c[0]) for c in HERMES_CASES] +
                         [("llama3_json", c[0]) for c in LLAMA_CASES])
def test_stream_token_by_token_matches_parsers(parser, text):
    content, calls, _ = stream(text, AUTO, parser, range(len(text)))
    assert (content, [(c.name, json.loads(c.arguments)) for c in calls]) == \
           (parse_tool_calls(text, AUTO, parser)[0], calls_of(parse_tool_calls(text, AUTO, parser)))


def test_stream_sends_content_and_calls_as_soon_as_decided():
    s = ToolCallStream(AUTO, "hermes")
    assert s.update("I'll check") == [{"content": "I'll check"}]
    assert s.update("I'll check. \n<tool_") == [{"content": "."}]   # the whitespace may belong to a call
    assert s.update("I'll check. \n<tool_call>\n" + hermes(*PARIS)[12:-3]) == []
    first = s.update("I'll check. \n" + hermes(*PARIS))
    assert first == [{"tool_calls": [{"index": 0, "id": s.calls[0].id, "type": "function",
                                      "function": {"name": "get_weather", "arguments": ""}}]},
                     {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}]
    assert s.update("I'll check. \n" + hermes(*PARIS) + "\n<tool_call>\n{") == []
    assert s.finish() == [{"content": "<tool_call>\n{"}]                    # never a call: content, unchanged
    llama = ToolCallStream(AUTO, "llama3_json")
    assert llama.update(" ") == [] and llama.update(" Par") == [{"content": " Par"}]   # not JSON: content at once
    required = ToolCallStream(check_tools(TOOLS, "required", None), "hermes")
    assert required.update(json.dumps(GOOD_TWO)[:60]) != [] and [c.name for c in required.calls] == ["get_weather"]


# ---- messages ---------------------------------------------------------------------------------------------
CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": [{"type": "text", "text": "Weather and time "}, {"type": "text", "text": "in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 °C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:05"}]},
]


def test_chat_messages_converts_tool_turns():
    assert chat_messages(CONVERSATION)[1:] == [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]},
        {"role": "tool", "content": "sunny, 21 °C", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "tool", "content": "14:05", "tool_call_id": "call_2", "name": "get_time"}]
    as_object = [CONVERSATION[1], {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "ping", "arguments": {}}}]}]
    assert chat_messages(as_object)[1]["tool_calls"][0]["function"]["arguments"] == {}


def with_message(i: int, **fields) -> list[dict]:
    return [*CONVERSATION[:i], {**CONVERSATION[i], **fields}, *CONVERSATION[i + 1:]]


def with_call(**fields) -> list[dict]:
    call = CONVERSATION[2]["tool_calls"][1]
    return with_message(2, tool_calls=[CONVERSATION[2]["tool_calls"][0], {**call, **fields}])


@pytest.mark.parametrize("messages, error", [
    ([], "messages must be a non-empty list"),
    ([CONVERSATION[0], "hi"], "messages[1] must be an object with a string role"),
    (with_message(1, content=5), "messages[1].content must be a string or text parts"),
    (with_message(2, tool_calls={"id": "call_1"}), "messages[2].tool_calls must be a list"),
    (with_call(type="code"), "messages[2].tool_calls[1] must be a function call object"),
    (with_call(id=None), "messages[2].tool_calls[1].id must be a string"),
    (with_call(function={"arguments": "{}"}), "messages[2].tool_calls[1].function must be an object with a string"),
    (with_call(function={"name": "get_time", "arguments": '{"tz": CET}'}),
     "messages[2].tool_calls[1].function.arguments: not valid JSON (Expecting value"),
    (with_call(function={"name": "get_time", "arguments": '["CET"]'}),
     "messages[2].tool_calls[1].function.arguments must be a JSON object"),
    (with_call(function={"name": "get_time"}), "messages[2].tool_calls[1].function.arguments must be a JSON object"),
    (with_message(3, tool_call_id=None), "messages[3].tool_call_id must be a string"),
    (with_message(4, tool_call_id="call_9"), "messages[4].tool_call_id: 'call_9' is no earlier"),
    ([CONVERSATION[3], *CONVERSATION], "messages[0].tool_call_id: 'call_1' is no earlier"),
])
def test_chat_messages_errors_name_their_field(messages, error):
    with pytest.raises(ValueError, match="^" + re.escape(error)):
        chat_messages(messages)


def test_embedded_template_ignores_tools(tokenizer):
    """SmolLM2's template renders neither tools nor an assistant's tool calls (content only): it takes the
    converted messages, tool results as "tool" turns, but its model can't be shown a function."""
    prompt = tokenizer.apply_chat_template(chat_messages(CONVERSATION), tools=AUTO.template_tools, tokenize=False,
                                           add_generation_prompt=True)
    assert "get_weather" not in prompt and "<|im_start|>assistant\n<|im_end|>" in prompt
    assert "<|im_start|>tool\nsunny, 21 °C<|im_end|>" in prompt and "<|im_start|>tool\n14:05<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == "system" %}{{ messages[0].content }}

{% endif %}You may call functions. Their signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one with <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == "system" %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages if message.role != "system" %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_hermes_template_round_trip(tokenizer):
    """Rendered by a Hermes-style template, the conversation's tool calls read back by the hermes parser as the
    client sent them; the tools and tool results are in the prompt."""
    prompt = tokenizer.apply_chat_template(chat_messages(CONVERSATION), tools=AUTO.template_tools,
                                           chat_template=HERMES_TEMPLATE, tokenize=False, add_generation_prompt=True)
    tools = prompt.split("<tools>\n")[1].split("</tools>")[0].splitlines()
    assert [json.loads(line) for line in tools] == TOOLS
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(turn, AUTO, "hermes")
    assert content == "" and [(c.name, c.arguments) for c in calls] == \
           [(c["function"]["name"], c["function"]["arguments"]) for c in CONVERSATION[2]["tool_calls"]]
    assert "<tool_response>\nsunny, 21 °C\n</tool_response>" in prompt and "<tool_response>\n14:05\n" in prompt
    assert prompt.startswith("<|im_start|>system\nYou are a weather bot.\n\nYou may call functions.")
    assert prompt.endswith("<|im_start|>assistant\n")
