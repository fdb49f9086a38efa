"""Structured outputs served (openai_http.py, grpc_api.py; the engine's side is test_structured_outputs.py): one
in-process server (embedded SmolLM2) driven through the `openai` client — realistic JSON schemas (json_schemas.py)
through response_format, greedy and sampled, each answer validated; json_object, regex, choice and grammars
through vLLM's structured_outputs; a stream; errors naming the field as the request spelled it, the engine serving
on — and through the gRPC Client and `jaxserve client --json-schema`. Requests go concurrently, so the engine
batches them."""
import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.cli import main
from jaxserve.client import Client
from jaxserve.engine.sampling_params import MAX_STRUCTURED_CHARS, StructuredOutputsParams
from jaxserve.serve import jaxserve_pb2 as pb

from helpers import MODEL, SERVER_KNOBS, base_url, in_process
from json_schemas import SCHEMAS

MAX_TOKENS = 300
SAMPLED = dict(temperature=0.8, seed=11)
PLAIN = [f"Write one sentence about the number {i}." for i in range(3)]
PERSON = SCHEMAS[0][1]
ANIMAL = "Describe your favourite animal as a JSON object."   # free JSON: a prompt the model answers briefly
# (kind, prompt, constraint, what the whole output must match)
CONSTRAINED = [
    ("regex", "What is the phone number of the city hall? Answer as (555) 123-4567.",
     {"regex": r"\(\d{3}\) \d{3}-\d{4}"}, r"\(\d{3}\) \d{3}-\d{4}"),
    ("regex", "When did the first person walk on the moon? Give the date.",
     {"regex": r"(19|20)\d{2}-(0[1-9]|1[0-2])-[0-3]\d"}, r"(19|20)\d{2}-(0[1-9]|1[0-2])-[0-3]\d"),
    ("choice", "Classify the sentiment: 'The food was cold and the waiter was rude.'",
     {"choice": ["positive", "negative", "neutral"]}, "positive|negative|neutral"),
    ("lark", "Write a sum of two to four small numbers.",
     {"grammar": 'start: NUM ("+" NUM)~1..3 "=" NUM\nNUM: /[0-9]{1,2}/'}, r"\d{1,2}(\+\d{1,2}){1,3}=\d{1,2}"),
    ("gbnf", "How many legs does a spider have? Answer in a sentence.",
     {"grammar": 'root ::= "The answer is " [0-9] [0-9]? "."'}, r"The answer is \d\d?\."),
]


@pytest.fixture(scope="module")
def server(smollm):
    cfg = EngineConfig(precompile=False, **{**SERVER_KNOBS, "max_num_seqs": 32, "num_blocks": 512})
    with in_process(LLMEngine(smollm, cfg)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=base_url(server) + "/v1", api_key="unused", max_retries=0, timeout=600) as c:
        yield c


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def ask(client, prompt: str, **kwargs):
    """A chat completion's one choice."""
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          **{"max_tokens": MAX_TOKENS, "temperature": 0, **kwargs}).choices[0]


def concurrently(fn, jobs: list) -> list:
    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(lambda job: fn(*job), jobs))


def schema_problem(choice, schema: dict) -> str | None:
    """Why the answer is not a valid, complete instance of schema (None: it is)."""
    try:
        jsonschema.validate(json.loads(choice.message.content), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None if choice.finish_reason == "stop" else f"finish_reason {choice.finish_reason}"


@pytest.mark.slow
def test_every_schema_is_answered_with_a_valid_instance_greedy_and_sampled(client):
    jobs = [(prompt, schema, sampling) for sampling in ({}, SAMPLED) for prompt, schema in SCHEMAS]
    choices = concurrently(lambda prompt, schema, sampling: ask(client, prompt, **sampling,
                                                                 response_format=json_schema_format(schema)), jobs)
    problems = [(prompt, "sampled" if sampling else "greedy", problem, c.message.content)
                for (prompt, schema, sampling), c in zip(jobs, choices)
                if (problem := schema_problem(c, schema)) is not None]
    assert not problems, problems


@pytest.mark.slow
def test_json_object_regex_choice_and_grammars_hold_on_both_endpoints(client):
    def answer(chat, prompt, body):
        if chat:
            choice = ask(client, prompt, extra_body=body)
            return choice.message.content, choice.finish_reason
        choice = client.completions.create(model=MODEL, prompt=prompt + "\n", max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=body).choices[0]
        return choice.text, choice.finish_reason
    jobs = [(chat, prompt, {"structured_outputs": constraint}) for chat in (True, False)
            for _, prompt, constraint, _ in CONSTRAINED]
    jobs += [(True, ANIMAL, {"structured_outputs": {"json_object": True}}),
             (True, ANIMAL, {"response_format": {"type": "json_object"}})]
    answers = concurrently(answer, jobs)
    assert all(reason == "stop" for _, reason in answers), [a for a in answers if a[1] != "stop"]
    for (kind, _, _, pattern), (text, _) in zip(CONSTRAINED * 2, answers):
        assert re.fullmatch(pattern, text), (kind, text)
    assert isinstance(json.loads(answers[-1][0]), dict) and answers[-1] == answers[-2], answers[-2:]


@pytest.mark.slow
def test_a_streamed_answer_concatenates_to_a_valid_instance(client):
    prompt, schema = SCHEMAS[1]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
        response_format=json_schema_format(schema), stream=True))
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    assert text == ask(client, prompt, response_format=json_schema_format(schema)).message.content


BAD = {   # name -> (request fields, param; the message starts with it)
    "regex": (dict(structured_outputs={"regex": "a[b"}), "structured_outputs.regex"),
    "grammar": (dict(structured_outputs={"grammar": "root ::= undefined"}), "structured_outputs.grammar"),
    "schema-properties": (dict(response_format=json_schema_format({"type": "object", "properties": 5})),
                          "response_format.json_schema.schema"),
    "schema-properties-vllm": (dict(structured_outputs={"json": {"type": "object", "properties": 5}}),
                               "structured_outputs.json"),
    "schema-unsupported-keyword": (dict(response_format=json_schema_format(
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True})), "response_format.json_schema.schema"),
    "schema-too-large": (dict(response_format=json_schema_format(
        {"type": "object", "description": "x" * MAX_STRUCTURED_CHARS})), "response_format.json_schema.schema"),
    "schema-not-an-object": (dict(response_format=json_schema_format([{"type": "string"}])),
                             "response_format.json_schema.schema"),
    "schema-not-an-object-vllm": (dict(structured_outputs={"json": 5}), "structured_outputs.json"),
    "schema-text-not-json": (dict(structured_outputs={"json": "{type: object"}), "structured_outputs.json"),
    "no-schema-name": (dict(response_format={"type": "json_schema", "json_schema": {"schema": PERSON}}),
                       "response_format.json_schema.name"),
    "response_format-type": (dict(response_format={"type": "yaml"}), "response_format"),
    "both": (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a+"}), "response_format"),
    "two-constraints": (dict(structured_outputs={"regex": "a+", "choice": ["a"]}), "structured_outputs"),
    "choice-empty": (dict(structured_outputs={"choice": []}), "structured_outputs.choice"),
    "unknown-option": (dict(structured_outputs={"regex": "a+", "disable_any_whitespace": True}),
                       "structured_outputs.disable_any_whitespace"),
    "guided_json": (dict(guided_json=PERSON), "guided_json"),
    "guided_choice": (dict(guided_choice=["a", "b"]), "guided_choice"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.slow
def test_a_bad_constraint_is_a_400_naming_its_field_and_the_engine_serves_on(server, client, case):
    fields, param = BAD[case]
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "Hi", max_tokens=4, extra_body=fields)
    assert err.value.body["param"] == param and err.value.body["message"].startswith(param), err.value.body
    if case.startswith("guided_"):
        assert "structured_outputs" in err.value.body["message"]
    assert ask(client, "Hi", max_tokens=4).finish_reason in ("stop", "length")
    assert server.engine_loop.stats()["serving"]


@pytest.mark.slow
def test_unconstrained_answers_beside_constrained_ones_are_as_alone(client):
    plain = lambda prompt: ask(client, prompt, max_tokens=24).message.content  # noqa: E731
    alone = [plain(prompt) for prompt in PLAIN]
    constrained = lambda prompt, schema: ask(client, prompt, response_format=json_schema_format(schema))  # noqa: E731
    jobs = [(constrained, job) for job in SCHEMAS[:8]] + [(plain, (prompt,)) for prompt in PLAIN]
    beside = concurrently(lambda fn, args: fn(*args), jobs)
    assert beside[8:] == alone
    assert all(schema_problem(c, schema) is None for c, (_, schema) in zip(beside[:8], SCHEMAS))


def grpc_call(server, scenario):
    async def main():
        async with Client(f"127.0.0.1:{server.grpc_port}") as c:
            return await scenario(c)
    return asyncio.run(main())


@pytest.mark.slow
def test_grpc_serves_a_schema_and_a_choice_and_refuses_a_bad_regex_naming_it(server):
    prompt, schema = SCHEMAS[3]
    messages = [{"role": "user", "content": prompt}]
    params = lambda **spec: SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,  # noqa: E731
                                           structured_outputs=StructuredOutputsParams(**spec))

    async def scenario(c):
        answers = await asyncio.gather(c.complete(messages, params(json=schema)),
                                       c.complete(messages, params(choice=["positive", "negative"])))
        errors = []
        for request in (c.complete(messages, params(regex="(unclosed")),   # the Client's conversion
                        c.stub.Complete(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(
                            json_schema='{"type": "object", "properties": 5}')))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await request
            errors.append((err.value.code(), err.value.details()))
        return [a.outputs[0] for a in answers], errors

    (as_json, choice), errors = grpc_call(server, scenario)
    jsonschema.validate(json.loads(as_json.text), schema)
    assert (as_json.finish_reason, choice.finish_reason, choice.text in ("positive", "negative")) == (
        "stop", "stop", True), (as_json, choice)
    assert [(code, details.split(":")[0]) for code, details in errors] == [
        (grpc.StatusCode.INVALID_ARGUMENT, "structured_outputs.regex"),
        (grpc.StatusCode.INVALID_ARGUMENT, "structured_outputs.json_schema")], errors
    assert server.engine_loop.stats()["serving"]


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.slow
def test_the_client_command_answers_in_a_json_schema_file(server, capsys, tmp_path, transport):
    prompt, schema = SCHEMAS[0]
    (path := tmp_path / "schema.json").write_text(json.dumps(schema))
    address = ["--url", base_url(server)] if transport == "http" else ["--port", str(server.grpc_port)]
    code = main(["client", *address, "--json-schema", str(path), "--temperature", "0", "--max-tokens", "200",
                 prompt])
    out = capsys.readouterr().out
    assert code == 0
    jsonschema.validate(json.loads(out), schema)
