"""Tool calling served on /v1/chat/completions (openai_http.py over tool_calls.py): one in-process server (embedded
SmolLM2, --tool-call-parser hermes) driven through the `openai` client. tool_choice "required" and a named function
constrain greedy answers to calls that validate against the functions' parameters, streamed deltas adding up to the
same calls; parallel_tool_calls; a round trip through the chat template (assistant tool_calls, a tool result);
tool_choice auto read back by the hermes parser, the model's output held to a Hermes-style answer by a structured
outputs choice (SmolLM2 never writes one by itself: its template shows it no tools); bad fields a 400 naming them,
the engine serving on. The flag and the parser a chat template tells need no server."""
import json

import httpx2
import jsonschema
import openai
import pytest

from jaxserve import EngineConfig, LLMEngine
from jaxserve.cli import build_parser, serve_options
from jaxserve.serve.server import ServeOptions
from jaxserve.serve.tool_calls import template_parser

from helpers import MODEL, SERVER_KNOBS, base_url, in_process

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What's the weather in Paris, and the time in Tokyo?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
HERMES_ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
                 '"celsius"}}\n</tool_call>')


@pytest.fixture(scope="module")
def server(smollm):
    with in_process(LLMEngine(smollm, EngineConfig(precompile=False, **SERVER_KNOBS)), tool_call_parser="hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=base_url(server) + "/v1", api_key="unused", max_retries=0, timeout=600) as c:
        yield c


def create(client, messages=ASK, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages,
                                          **{"tools": TOOLS, "temperature": 0, "max_tokens": 100, **kwargs})


def calls_of(message) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, every one checked against its function's parameters."""
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    for name, arguments in calls:
        jsonschema.validate(arguments, PARAMETERS[name])
    return calls


def reassembled(chunks) -> dict[int, tuple[str | None, list[tuple[str, dict]], str | None]]:
    """Each streamed choice as (content, calls, finish reason), its deltas added up as OpenAI clients do: a call's
    id, type and name come first, its arguments after."""
    choices = {}
    for chunk in chunks:
        for ch in chunk.choices:
            content, calls, _ = choices.get(ch.index, (None, [], None))
            if ch.delta.content:
                content = (content or "") + ch.delta.content
            for part in ch.delta.tool_calls or []:
                if part.id is not None:
                    assert (part.index, part.type, part.id[:5]) == (len(calls), "function", "call_"), part
                    calls.append([part.function.name, ""])
                calls[part.index][1] += part.function.arguments or ""
            choices[ch.index] = (content, calls, ch.finish_reason)
    return {i: (content, [(name, json.loads(args)) for name, args in calls], reason)
            for i, (content, calls, reason) in choices.items()}


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
@pytest.mark.slow
def test_a_forced_choice_answers_with_valid_calls_and_streams_the_same(client, choice):
    whole = create(client, tool_choice=choice)
    message, reason = whole.choices[0].message, whole.choices[0].finish_reason
    calls = calls_of(message)
    assert (message.content, reason, len(calls) >= 1) == (None, "tool_calls", True), whole
    assert choice == "required" or {name for name, _ in calls} == {"get_time"}
    chunks = list(create(client, tool_choice=choice, stream=True, stream_options={"include_usage": True}))
    assert reassembled(chunks[:-1]) == {0: (None, calls, "tool_calls")}
    assert all(ch.delta.role or ch.delta.tool_calls or ch.finish_reason for c in chunks[:-1] for ch in c.choices)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage == whole.usage


@pytest.mark.slow
def test_each_of_n_sampled_choices_streams_its_own_calls(client):
    kwargs = dict(tool_choice="required", n=2, temperature=0.8, seed=5)
    whole = create(client, **kwargs)
    want = {c.index: (None, calls_of(c.message), c.finish_reason) for c in whole.choices}
    assert reassembled(create(client, **kwargs, stream=True)) == want
    assert [reason for _, _, reason in want.values()] == ["tool_calls"] * 2


@pytest.mark.slow
def test_parallel_tool_calls_false_makes_one_call_true_at_least_one(client):
    one = create(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    some = create(client, tool_choice="required", parallel_tool_calls=True).choices[0]
    assert (len(calls_of(one.message)), one.finish_reason) == (1, "tool_calls")
    assert len(calls_of(some.message)) >= 1 and some.finish_reason == "tool_calls"


@pytest.mark.slow
def test_a_call_and_its_result_go_back_through_the_template_and_get_an_answer(server, client):
    call = create(client, tool_choice=NAMED).choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "14:05, Tuesday"}]
    answer = create(client, messages=history, tool_choice="none", max_tokens=24)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")
    tokenized = httpx2.post(base_url(server) + "/tokenize", json={"messages": history}, timeout=30).json()
    prompt = httpx2.post(base_url(server) + "/detokenize", json={"tokens": tokenized["tokens"]}, timeout=30).json()
    # the same prompt (tool_choice none shows no tools), the call's result in it
    assert tokenized["count"] == answer.usage.prompt_tokens
    assert "<|im_start|>tool\n14:05, Tuesday<|im_end|>" in prompt["prompt"]


@pytest.mark.slow
def test_auto_reads_the_models_own_calls_with_the_parser(client):
    hermes = dict(tool_choice="auto", extra_body={"structured_outputs": {"choice": [HERMES_ANSWER]}})
    whole = create(client, **hermes).choices[0]
    assert (whole.message.content, calls_of(whole.message), whole.finish_reason) == (
        "Let me check.", [("get_weather", {"city": "Paris", "unit": "celsius"})], "tool_calls")
    assert reassembled(create(client, **hermes, stream=True)) == {
        0: ("Let me check.", [("get_weather", {"city": "Paris", "unit": "celsius"})], "tool_calls")}
    plain = create(client, max_tokens=24).choices[0]   # auto by default; the model writes no call by itself
    assert plain.message.content and plain.message.tool_calls is None and plain.finish_reason in ("stop", "length")


@pytest.mark.slow
def test_auto_without_a_parser_is_a_400_naming_the_ways_out(server, client, monkeypatch):
    monkeypatch.setattr(server.openai, "tool_parser", None)   # as SmolLM2's template tells none
    with pytest.raises(openai.BadRequestError) as err:
        create(client)
    message = err.value.body["message"]
    assert err.value.body["param"] == "tool_choice" and "--tool-call-parser" in message and "'required'" in message
    assert create(client, tool_choice="required").choices[0].finish_reason == "tool_calls"


def tool_turns(**call_fields) -> list[dict]:
    """ASK, an assistant's call (with call_fields), and its result."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone": "JST"}'}}
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [{**call, **call_fields}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "14:05"}]


BAD = {   # name -> (request fields, param; the message starts with it unless None)
    "duplicate-name": (dict(tools=[WEATHER, TIME, WEATHER]), "tools[2].function.name"),
    "undeclared-choice": (dict(tool_choice={"type": "function", "function": {"name": "get_stock"}}),
                          "tool_choice.function.name"),
    "choice-kind": (dict(tool_choice="always"), "tool_choice"),
    "auto-without-tools": (dict(tools=None, tool_choice="auto"), "tool_choice"),
    "parallel": (dict(parallel_tool_calls="yes"), "parallel_tool_calls"),
    "tool-not-a-function": (dict(tools=[{"type": "retrieval"}]), "tools[0].type"),
    "arguments-not-json": (dict(messages=tool_turns(function={"name": "get_time", "arguments": "{timezone: JST}"})),
                           "messages[1].tool_calls[0].function.arguments"),
    "call-without-id": (dict(messages=tool_turns(id=None)), "messages[1].tool_calls[0].id"),
    "tool-without-call-id": (dict(messages=[*tool_turns()[:2], {"role": "tool", "content": "14:05"}]),
                             "messages[2].tool_call_id"),
    "tool-answering-nothing": (dict(messages=[*ASK, {"role": "tool", "tool_call_id": "call_1", "content": "14:05"}]),
                               "messages[1].tool_call_id"),
    "with-response_format": (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    "with-structured_outputs": (dict(tool_choice=NAMED, extra_body={"structured_outputs": {"regex": "a+"}}),
                                "tool_choice"),
    "schema-the-grammar-refuses": (dict(tool_choice="required", tools=[{"type": "function", "function": {
        "name": "tag", "parameters": {"properties": {"tags": {"type": "array", "items": {"type": "integer"},
                                                              "uniqueItems": True}}}}}]), "tools"),
    "functions": (dict(tools=None, extra_body={"functions": [WEATHER["function"]]}), "functions"),
    "function_call": (dict(tools=None, extra_body={"function_call": "auto"}), "function_call"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.slow
def test_a_bad_tool_field_is_a_400_naming_it_and_the_engine_serves_on(server, client, case):
    fields, param = BAD[case]
    with pytest.raises(openai.BadRequestError) as err:
        create(client, **{"max_tokens": 4, **fields})
    assert err.value.body["param"] == param and err.value.body["message"].startswith(param), err.value.body
    if case.startswith("with-"):   # the message names both
        assert err.value.body["message"].startswith(f"tool_choice and {case.removeprefix('with-')}:"), err.value.body
    if case.startswith("function"):
        assert "tools" in err.value.body["message"]
    assert create(client, tool_choice="none", max_tokens=4).choices[0].finish_reason in ("stop", "length")
    assert server.engine_loop.stats()["serving"]


def test_the_parser_comes_from_the_flag_else_the_chat_template():
    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json"])
    assert serve_options(args).tool_call_parser == "llama3_json"
    assert serve_options(build_parser().parse_args(["serve"])).tool_call_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "mistral"])
    with pytest.raises(ValueError, match="^tool_call_parser must be one of hermes, llama3_json"):
        ServeOptions(tool_call_parser="mistral")
    assert [template_parser(t) for t in (
        "{% for tool in tools %}<tool_call>{{ tool | tojson }}</tool_call>{% endfor %}",
        '{{- "<|python_tag|>" + tool_call.arguments.code }}',
        {"default": "{{ messages }}", "tool_use": "<tool_call>"},
        "<|im_start|>{{ message['role'] }}", None)] == ["hermes", "llama3_json", "hermes", None, None]
