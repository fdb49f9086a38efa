"""`jaxserve client` (jaxserve/client.py, cli.cmd_client) against in-process servers: PROMPT as a chat through the
server's chat template (with --system), or with --raw a plain completion, over gRPC (--host/--port) and HTTP (--url),
each checked against the offline API; gRPC's chat messages refused, naming `messages`, where the model has no
template or no tokenizer; one clean line when no server answers, a flag is wrong or the server refuses."""
import asyncio
import copy
import dataclasses

import grpc
import jax.numpy as jnp
import pytest

from jaxserve import LLM, EngineConfig, LLMEngine, SamplingParams
from jaxserve.cli import main
from jaxserve.client import Client, ClientError, grpc_reply, http_reply
from jaxserve.models.loader import random_model
from jaxserve.serve import jaxserve_pb2 as pb

from helpers import SERVER_KNOBS, TINY_NO_EOS, base_url, free_port, in_process

KEY = "client-key"
QUESTION = "Name three colours."
SYSTEM = "You speak only French."
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
GREEDY_FLAGS = ["--max-tokens", "12", "--temperature", "0"]


@pytest.fixture(scope="module")
def server(smollm):
    with in_process(LLMEngine(smollm, EngineConfig(precompile=False, **SERVER_KNOBS)), api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def offline(smollm):
    return LLM(smollm, precompile=False, **SERVER_KNOBS)


def address(server, transport: str) -> list[str]:
    return ["--url", base_url(server)] if transport == "http" else ["--port", str(server.grpc_port)]


def client_cli(capsys, *args: str) -> tuple[int | str, str, str]:
    """`jaxserve client ARGS` in this process: its exit code (or SystemExit's message), stdout, stderr."""
    try:
        code = main(["client", *args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def conversation(system: str | None) -> list[dict]:
    return [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def answers(offline) -> dict[str, str]:
    """The offline API's greedy answer to QUESTION asked each way the client can ask it."""
    outs = {"chat": offline.chat(conversation(None), GREEDY, use_tqdm=False),
            "system": offline.chat(conversation(SYSTEM), GREEDY, use_tqdm=False),
            "raw": offline.generate([QUESTION], GREEDY, use_tqdm=False)}
    return {mode: out[0].outputs[0].text for mode, out in outs.items()}


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.parametrize("mode", ["chat", "system", "raw"])
@pytest.mark.slow
def test_client_chats_by_default_and_completes_with_raw(server, answers, capsys, transport, mode):
    flags = {"chat": [], "system": ["--system", SYSTEM], "raw": ["--raw"]}[mode]
    code, out, err = client_cli(capsys, *address(server, transport), "--api-key", KEY, *GREEDY_FLAGS, *flags, QUESTION)
    assert (code, out) == (0, answers[mode] + "\n"), err
    assert len(set(answers.values())) == 3   # each way asks the model something else


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.slow
def test_a_reply_arrives_in_pieces(server, answers, transport):
    async def pieces():
        if transport == "http":
            reply = http_reply(base_url(server) + "/v1", conversation(None), GREEDY, api_key=KEY)
        else:
            reply = grpc_reply(f"127.0.0.1:{server.grpc_port}", conversation(None), GREEDY, api_key=KEY)
        return [piece async for piece in reply]

    got = asyncio.run(pieces())
    assert len([p for p in got if p]) > 3 and "".join(got) == answers["chat"]


def templateless(loaded):
    tokenizer = copy.deepcopy(loaded.tokenizer)
    tokenizer.chat_template = None
    return dataclasses.replace(loaded, tokenizer=tokenizer)


@pytest.mark.slow
def test_chat_without_a_chat_template_is_refused_naming_messages(smollm, capsys):
    """The server refuses (no fallback): the client's line says so and points at --raw; nothing runs a step."""
    with in_process(LLMEngine(templateless(smollm), EngineConfig(precompile=False, **SERVER_KNOBS))) as s:
        grpc_code, out, err = client_cli(capsys, "--port", str(s.grpc_port), QUESTION)
        http_code, http_out, _ = client_cli(capsys, "--url", base_url(s), QUESTION)
    assert out == http_out == "" and "Traceback" not in err
    assert grpc_code == "jaxserve client: error: INVALID_ARGUMENT: messages: this model has no chat template " \
                        "(--raw sends PROMPT as a plain completion)"
    assert http_code == "jaxserve client: error: HTTP 400: messages: this model has no chat template " \
                        "(--raw sends PROMPT as a plain completion)"


def test_grpc_messages_need_a_tokenizer_and_come_alone():
    messages = [pb.ChatMessage(role="user", content="Hi")]
    engine = LLMEngine(random_model(TINY_NO_EOS, jnp.float32), EngineConfig(precompile=False, **SERVER_KNOBS))

    async def refusals(target):
        errors = []
        async with Client(target) as c:
            for request in (pb.GenerateRequest(messages=messages), pb.GenerateRequest(prompt="Hi", messages=messages)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await c.stub.Complete(request)
                errors.append((err.value.code(), err.value.details()))
        return errors

    with in_process(engine) as s:
        errors = asyncio.run(refusals(f"127.0.0.1:{s.grpc_port}"))
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert errors == [(invalid, "messages: this model has no tokenizer; send prompt_token_ids"),
                      (invalid, "prompt and messages: give one of prompt, prompt_token_ids and messages")]


def test_an_engine_failure_is_the_servers_unavailable_not_no_server():
    """Both are UNAVAILABLE: a connected channel tells the server's own apart."""
    engine = LLMEngine(random_model(TINY_NO_EOS, jnp.float32), EngineConfig(precompile=False, **SERVER_KNOBS))

    def broken_step():
        raise RuntimeError("injected device failure")

    async def reply(target):
        return [piece async for piece in grpc_reply(target, [1, 2, 3], SamplingParams(max_tokens=4))]

    with in_process(engine) as s:
        s.engine_loop.replicas[0].engine.step = broken_step
        with pytest.raises(ClientError) as err:
            asyncio.run(reply(f"127.0.0.1:{s.grpc_port}"))
    assert str(err.value).startswith("UNAVAILABLE: ") and "injected device failure" in str(err.value)


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_no_server_is_one_line_naming_the_address(capsys, transport):
    port = free_port()
    flags = ["--url", f"http://127.0.0.1:{port}"] if transport == "http" else ["--port", str(port)]
    code, out, err = client_cli(capsys, *flags, "--timeout", "30", "Hi")
    assert isinstance(code, str) and code.startswith("jaxserve client: error: cannot connect to "), code
    assert f"127.0.0.1:{port}" in code and "is `jaxserve serve` running there" in code and "\n" not in code
    assert out == "" and "Traceback" not in err


@pytest.mark.parametrize("flags, message", [
    (["--url", "host:8000"], "--url host:8000: give the server's HTTP address, http://HOST:PORT (its --port)"),
    (["--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem: No such file or directory"),
    (["--json-schema", "/nonexistent/s.json"], "--json-schema /nonexistent/s.json: No such file or directory"),
    (["--json-schema", "/dev/null"], "--json-schema /dev/null: structured_outputs.json: not valid JSON "
                                     "(Expecting value: line 1 column 1 (char 0))"),
], ids=["url-without-scheme", "missing-ca", "missing-schema", "schema-not-json"])
def test_bad_flags_are_one_line(capsys, flags, message):
    code, out, err = client_cli(capsys, *flags, "Hi")
    assert (code, out, err) == (2, "", f"jaxserve client: error: {message}\n")


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.slow
def test_a_refusal_prints_the_servers_message(server, capsys, transport):
    wrong_key = client_cli(capsys, *address(server, transport), "--api-key", "wrong", "Hi")[0]
    too_long = client_cli(capsys, *address(server, transport), "--api-key", KEY, "--max-tokens", "100000", "Hi")[0]
    status = {"grpc": ("UNAUTHENTICATED", "INVALID_ARGUMENT"), "http": ("HTTP 401", "HTTP 400")}[transport]
    assert wrong_key.startswith(f"jaxserve client: error: {status[0]}: ") and \
        "Bearer <api key> missing or wrong" in wrong_key, wrong_key
    assert too_long.startswith(f"jaxserve client: error: {status[1]}: max_tokens") and "512" in too_long, too_long
    assert "\n" not in wrong_key + too_long
