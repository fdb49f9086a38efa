"""The OpenAI-compatible HTTP front end through the official `openai` client (and httpx2, which it is built on):
one in-process server per module (embedded SmolLM2, small engine, lazy compile) on loopback, checked against the
offline API; a second one over a stuck, then failing, engine step for the refusal statuses; a third over a tiny
random model without a tokenizer (the benchmarks' kind), served token ids; a fourth like it for the log lines."""
import json
import logging
import random
import re
import socket
import threading
import time

import httpx2
import jax.numpy as jnp
import openai
import pytest

from jaxserve import LLM, EngineConfig, LLMEngine, SamplingParams
from jaxserve.engine.llm_engine import NeverFits, QueueFull
from jaxserve.models.loader import random_model
from jaxserve.serve import engine_loop
from jaxserve.serve.engine_loop import EngineFailed, Overloaded
from jaxserve.serve.openai_http import ENGINE_FIELDS, UNSUPPORTED, api_error

from helpers import (MODEL, MODEL_ALIAS, SERVER_KNOBS, TINY_NO_EOS, base_url, in_process, loop_thread_name,
                     record_tokenize_threads, wait_idle)

KEY = "test-key"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LONG = {"prompt": "Count to a thousand:", "max_tokens": 480, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(smollm):
    with in_process(LLMEngine(smollm, EngineConfig(precompile=False, **SERVER_KNOBS)), api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=base_url(server) + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(smollm):
    return LLM(smollm, precompile=False, **SERVER_KNOBS)


@pytest.mark.slow
def test_completion_matches_offline(client, offline):
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    want = offline.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert (got.object, got.model, got.id.startswith("cmpl-")) == ("text_completion", MODEL, True)
    assert [(c.index, c.text, c.finish_reason) for c in got.choices] == [(0, want.outputs[0].text, "length")]
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (
        len(want.prompt_token_ids), 12, len(want.prompt_token_ids) + 12)


@pytest.mark.slow
def test_chat_matches_llm_chat(client, offline):
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=24, temperature=0)
    want = offline.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    c = want.outputs[0]
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == (c.text, c.finish_reason)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids), len(c.token_ids))


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.slow
def test_streamed_chunks_concatenate_to_the_full_text_with_usage_last(client, chat):
    if chat:
        kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
        create, text = client.chat.completions.create, lambda ch: ch.delta.content or ""
        full = create(**kwargs).choices[0].message.content
    else:
        kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
        create, text = client.completions.create, lambda ch: ch.text
        full = create(**kwargs).choices[0].text
    chunks = list(create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert len(chunks) > 3 and all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert "".join(text(ch) for c in chunks[:-1] for ch in c.choices) == full
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    if chat:
        assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"


@pytest.mark.slow
def test_n_seed_and_stop_match_offline_per_choice(client, offline):
    params = SamplingParams(n=3, temperature=0.9, top_p=1.0, seed=7, max_tokens=12, stop=["."])
    kwargs = dict(model=MODEL, prompt=PROMPT, n=3, temperature=0.9, top_p=1.0, seed=7, max_tokens=12, stop=["."])
    full = client.completions.create(**kwargs)
    streamed = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for ch in chunk.choices:
            text, _ = streamed.get(ch.index, ("", None))
            streamed[ch.index] = (text + ch.text, ch.finish_reason)
    want = [(c.text, c.finish_reason) for c in offline.generate([PROMPT], params, use_tqdm=False)[0].outputs]
    assert [(c.text, c.finish_reason) for c in full.choices] == want
    assert [streamed[i] for i in range(3)] == want
    assert len(set(want)) > 1 and any(reason == "stop" for _, reason in want)


@pytest.mark.slow
def test_a_list_of_text_prompts_is_answered_as_the_offline_batch(client, offline):
    prompts = [PROMPT, "Hi", "def fib(n):"]
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert [(c.index, c.text) for c in got.choices] == [(i, w.outputs[0].text) for i, w in enumerate(want)]
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)


@pytest.mark.slow
def test_logprobs_completion_and_chat(client, offline, smollm):
    decode = lambda t: smollm.tokenizer.decode([t])  # noqa: E731
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    want = offline.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3), use_tqdm=False)
    c, lp = want[0].outputs[0], got.choices[0].logprobs
    assert lp.tokens == [decode(t) for t in c.token_ids]
    assert lp.token_logprobs == pytest.approx([d[t] for t, d in zip(c.token_ids, c.logprobs)], abs=1e-4)
    assert [len(top) for top in lp.top_logprobs] == [3] * 6
    assert all(max(top.values()) == pytest.approx(v, abs=1e-4) for top, v in zip(lp.top_logprobs, lp.token_logprobs))

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=2)
    want = offline.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=6, logprobs=2), use_tqdm=False)
    c, content = want[0].outputs[0], chat.choices[0].logprobs.content
    assert [e.token for e in content] == [decode(t) for t in c.token_ids]
    assert [e.logprob for e in content] == pytest.approx([d[t] for t, d in zip(c.token_ids, c.logprobs)], abs=1e-4)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in content)   # greedy
    assert bytes(content[0].bytes).decode() == content[0].token


BAD = {   # name -> (chat, request fields, status, param)
    "top_p": (False, dict(top_p=1.5), 400, "top_p"),
    "temperature": (True, dict(temperature=-1), 400, "temperature"),
    "n": (False, dict(n=0), 400, "n"),
    "n>max_num_seqs": (False, dict(n=17), 400, "n"),                       # the engine's check, on its thread
    "max_completion_tokens": (True, dict(max_completion_tokens=0), 400, "max_completion_tokens"),
    "top_logprobs": (True, dict(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    "top_logprobs-alone": (True, dict(top_logprobs=2), 400, "top_logprobs"),
    "messages": (True, dict(messages=[]), 400, "messages"),
    "prompt-empty": (False, dict(prompt=""), 400, "prompt"),
    "prompt-too-long": (False, dict(prompt=[1] * 600), 400, "prompt"),
    "prompt-batch-item-too-long": (False, dict(prompt=["a", [1] * 600]), 400, "prompt"),
    "prompt-batch-item-empty": (False, dict(prompt=["a", ""]), 400, "prompt"),
    "stop": (False, dict(stop=[""]), 400, "stop"),
    "cache_salt": (False, dict(cache_salt=7), 400, "cache_salt"),
    "cache_salt-too-long": (False, dict(cache_salt="s" * 10_000), 400, "cache_salt"),   # the engine's check
    "return_token_ids": (False, dict(return_token_ids="yes"), 400, "return_token_ids"),
    "model": (True, dict(model="gpt-4"), 404, "model"),
    "max_tokens-past-the-context": (False, dict(max_tokens=1_000_000), 400, "max_tokens"),
    "max_completion_tokens-past": (True, dict(max_completion_tokens=600), 400, "max_completion_tokens"),
    "best_of": (False, dict(best_of=2), 400, "best_of"),                  # fields nothing reads: refused, not
    "best_of-with-n": (False, dict(n=2, best_of=2), 400, "best_of"),      # ignored
    "guided_json": (True, dict(guided_json={"type": "object"}), 400, "guided_json"),
    "guided_regex": (False, dict(guided_regex="a+"), 400, "guided_regex"),
    "guided_choice": (True, dict(guided_choice=["yes", "no"]), 400, "guided_choice"),
    "guided_grammar": (False, dict(guided_grammar="root ::= 'a'"), 400, "guided_grammar"),
    "guided_decoding_backend": (True, dict(guided_decoding_backend="xgrammar"), 400, "guided_decoding_backend"),
    "structured_outputs": (False, dict(structured_outputs={"regex": "a["}), 400, "structured_outputs.regex"),
    "structured_outputs-two": (False, dict(structured_outputs={"regex": "a", "choice": ["b"]}), 400,
                               "structured_outputs"),
    "response_format": (True, dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
                        "response_format.json_schema.schema"),
    "response_format-type": (False, dict(response_format={"type": "xml"}), 400, "response_format"),
    "tools": (True, dict(tools={"name": "f"}), 400, "tools"),
    "tools-auto-without-a-parser": (True, dict(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
                                    "tool_choice"),   # SmolLM2's chat template tells no tool-call parser
    "tool_choice": (True, dict(tool_choice="auto"), 400, "tool_choice"),
    "parallel_tool_calls": (True, dict(parallel_tool_calls="yes"), 400, "parallel_tool_calls"),
    "tools-on-completions": (False, dict(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    "functions": (True, dict(functions=[{"name": "f"}]), 400, "functions"),
    "function_call": (True, dict(function_call="auto"), 400, "function_call"),
    "logit_bias": (False, dict(logit_bias={"5": 10}), 400, "logit_bias"),
    "echo": (False, dict(echo=True), 400, "echo"),
    "suffix": (False, dict(suffix="!"), 400, "suffix"),
    "prompt_logprobs": (False, dict(prompt_logprobs=1), 400, "prompt_logprobs"),
    "top_logprobs-on-completions": (False, dict(top_logprobs=2), 400, "top_logprobs"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.slow
def test_bad_input_is_an_openai_error_naming_the_field(client, server, case):
    chat, fields, status, param = BAD[case]
    request = dict(model=MODEL, max_tokens=4, **({"messages": MESSAGES} if chat else {"prompt": PROMPT}))
    request.update(fields)
    create = client.chat.completions.create if chat else client.completions.create
    with pytest.raises(openai.APIStatusError) as err:
        create(**{k: v for k, v in request.items() if k in ("model", "messages", "prompt")},
               extra_body={k: v for k, v in request.items() if k not in ("model", "messages", "prompt")})
    assert err.value.status_code == status
    assert err.value.body["param"] == param and err.value.body["type"] and err.value.body["message"], err.value.body
    if param.startswith(("structured_outputs", "response_format", "guided_")):   # paths named as the request has them
        assert err.value.body["message"].startswith(param), err.value.body
    if param.startswith("guided_"):   # vLLM's removed fields: the message names what replaced them
        assert "structured_outputs" in err.value.body["message"], err.value.body
    assert server.engine_loop.stats()["serving"]


@pytest.mark.slow
def test_api_key_health_models_metrics_and_unknown_routes(server, client):
    url = base_url(server)
    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as err:
            wrong.models.list()
    assert err.value.body["code"] == "invalid_api_key"
    assert httpx2.post(url + "/v1/completions", json={"prompt": PROMPT}, timeout=10).status_code == 401
    assert [m.id for m in client.models.list()] == [MODEL, MODEL_ALIAS]   # every served name
    assert httpx2.get(url + "/health", timeout=10).status_code == 200        # probes need no key
    unknown = httpx2.get(url + "/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    assert client.completions.create(model=MODEL_ALIAS, prompt=PROMPT, max_tokens=2).model == MODEL   # the first
    assert httpx2.get(url + "/metrics", timeout=10).status_code == 401          # the key guards metrics too
    metrics = httpx2.get(url + "/metrics", headers={"Authorization": f"bearer {KEY}"}, timeout=10).text
    finished = re.search(r'^jaxserve_requests_total\{outcome="finished"\} (\S+)$', metrics, re.M)
    assert finished and float(finished[1]) >= 1 and "jaxserve_time_to_first_token_seconds_count" in metrics


@pytest.mark.slow
def test_tokenize_detokenize_version_and_model_card(server, smollm):
    url, auth = base_url(server), {"Authorization": f"Bearer {KEY}"}
    post = lambda path, body: httpx2.post(url + path, json=body, headers=auth, timeout=30)  # noqa: E731
    ids = smollm.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert post("/tokenize", {"prompt": PROMPT}).json() == {"count": len(ids), "max_model_len": 512, "tokens": ids}
    chat = post("/tokenize", {"model": MODEL, "messages": MESSAGES}).json()["tokens"]
    text = smollm.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat == smollm.tokenizer.encode(text, add_special_tokens=False)
    assert post("/detokenize", {"tokens": ids}).json() == {"prompt": PROMPT}
    for path, body, param in (("/tokenize", {"prompt": 3}, "prompt"), ("/tokenize", {"text": "a"}, "text"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": "a"}, "tokens")):
        bad = post(path, body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (path, body, bad.text)
    assert httpx2.post(url + "/tokenize", json={"prompt": "a"}, timeout=10).status_code == 401
    assert httpx2.get(url + "/version", headers=auth, timeout=10).json()["version"]
    card = httpx2.get(url + f"/v1/models/{MODEL}", headers=auth, timeout=10).json()
    assert card["id"] == MODEL and card["max_model_len"] == 512
    assert httpx2.get(url + f"/v1/models/{MODEL_ALIAS}", headers=auth, timeout=10).json()["id"] == MODEL_ALIAS
    missing = httpx2.get(url + "/v1/models/gpt-4", headers=auth, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert f"{MODEL!r} or {MODEL_ALIAS!r}" in missing.json()["error"]["message"]
    assert server.engine_loop.stats()["serving"]


@pytest.mark.slow
def test_connections_send_at_once(server, client):
    """TCP_NODELAY on every accepted connection: without it Nagle holds each streamed event until the client's
    delayed ACK, ~40 ms (the listening socket must carry it: asyncio does not set it on uvicorn's)."""
    client.models.list()   # leaves a kept-alive connection
    sockets = [c.transport.get_extra_info("socket") for c in server.http.uvicorn.server_state.connections]
    assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)


@pytest.mark.parametrize("stream, batch", [(True, False), (False, False), (True, True), (False, True)],
                         ids=["stream", "non-stream", "stream-batch", "non-stream-batch"])
@pytest.mark.slow
def test_a_disconnected_client_frees_its_slot_and_blocks_at_once(server, stream, batch):
    before = wait_idle(server)
    prompt = [LONG["prompt"], "Count to two thousand:"] if batch else LONG["prompt"]
    headers, body = {"Authorization": f"Bearer {KEY}"}, {"model": MODEL, **LONG, "prompt": prompt, "stream": stream}
    # non-stream: the client gives up after 3 s; stream: the first chunk may wait for a graph to compile
    with httpx2.Client(base_url=base_url(server), headers=headers,
                       timeout=httpx2.Timeout(60, read=60 if stream else 3)) as http:
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as response:
                first = next(line for line in response.iter_lines() if line)
            assert response.status_code == 200 and json.loads(first.removeprefix("data: "))["choices"]
        else:   # the client gives up waiting and closes the connection
            with pytest.raises(httpx2.ReadTimeout):
                http.post("/v1/completions", json=body)
    after = wait_idle(server)
    assert (after["running"], after["waiting"], after["pending"], after["kv_blocks_used"]) == (0, 0, 0, 0)
    assert 0 < after["engine_steps"] - before["engine_steps"] < LONG["max_tokens"] // 2   # aborted, not run out


@pytest.mark.slow
def test_refusal_statuses_and_tokenization_off_the_engine_thread(smollm, monkeypatch):
    """Can never fit: 400; past max_waiting: 429; after an engine failure: 503, /health 503. Text is templated
    and tokenized on the tokenizer thread."""
    gate, threads = threading.Event(), []
    record_tokenize_threads(monkeypatch, threads)
    engine = LLMEngine(smollm, EngineConfig(precompile=False, **{**SERVER_KNOBS, "num_blocks": 24}))

    def stuck_step():
        gate.wait(30)
        raise RuntimeError("injected device failure")
    engine.step = stuck_step

    with in_process(engine, max_waiting=1) as server, \
            openai.OpenAI(base_url=base_url(server) + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        with pytest.raises(openai.BadRequestError) as never_fits:
            c.completions.create(model=MODEL, prompt=list(range(1, 300)), max_tokens=200)
        waiting = []
        first = threading.Thread(target=lambda: waiting.append(error_of(c.chat.completions.create, model=MODEL,
                                                                        messages=MESSAGES, max_tokens=4)))
        first.start()
        deadline = time.monotonic() + 30
        while server.engine_loop.stats()["pending"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        overloaded = error_of(c.completions.create, model=MODEL, prompt=PROMPT, max_tokens=4)
        gate.set()
        first.join(30)
        after = error_of(c.completions.create, model=MODEL, prompt=PROMPT, max_tokens=4)
        health = httpx2.get(base_url(server) + "/health", timeout=10)
    assert never_fits.value.body["code"] == "context_length_exceeded" and "KV pool" in never_fits.value.message
    assert overloaded.status_code == 429 and "max_waiting" in overloaded.message
    assert [e.status_code for e in waiting + [after]] == [503, 503] and "injected" in after.message
    assert health.status_code == 503
    assert threads and all(name.startswith("jaxserve-tokenizer") for name in threads)


def error_of(create, **kwargs) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as err:
        create(**kwargs)
    return err.value


FUZZ_FIELDS = sorted({*ENGINE_FIELDS, *UNSUPPORTED, "model", "messages", "max_completion_tokens", "top_logprobs",
                      "stream", "stream_options", "return_token_ids", "user", "priority", "prompt_logprobs",
                      "response_format", "guided_json", "tools", "tool_choice", "parallel_tool_calls", "functions",
                      "function_call"})
FUZZ_REQUESTS = 150   # per endpoint


def fuzz_value(rng: random.Random, depth: int = 0):
    """A random JSON value: edge numbers, odd text (lone surrogates, long), and lists / objects of them."""
    scalars = [None, True, False, 0, 1, -1, 2, 7, 2**31, 2**63, -(2**70), 0.5, -0.0, 1e-300, 1e308, -1e308,
               float("nan"), float("inf"), "", "a", "\ud800", "x\udfff", "<|im_end|>", "s" * 5000, "user"]
    kind = rng.randrange(4) if depth < 2 else 0
    if kind == 0:
        return rng.choice(scalars)
    if kind == 1:
        return [fuzz_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 3, 600]) if depth == 0 else 2)]
    if kind == 2:
        return {rng.choice(["role", "content", "type", "text", "include_usage", "\ud800"]): fuzz_value(rng, depth + 1)
                for _ in range(rng.randrange(3))}
    return rng.choice([[{"role": "user", "content": fuzz_value(rng, 1)}], {"type": "text"}, list(range(1, 700))])


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.slow
def test_random_values_in_every_field_get_200_or_4xx_and_the_engine_keeps_serving(server, chat):
    """Whatever a request's fields hold, the answer is a success or a 4xx naming the problem: never a 500, never
    an error on the engine thread (which would end the server)."""
    seed = random.randrange(2**32)
    rng, url = random.Random(seed), base_url(server) + ("/v1/chat/completions" if chat else "/v1/completions")
    base = {"model": MODEL, "max_tokens": 2, **({"messages": MESSAGES} if chat else {"prompt": PROMPT})}
    with httpx2.Client(headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
                       timeout=120) as http:
        for _ in range(FUZZ_REQUESTS):
            request = {**base, **{rng.choice(FUZZ_FIELDS): fuzz_value(rng) for _ in range(rng.randrange(1, 4))}}
            response = http.post(url, content=json.dumps(request))
            detail = f"seed {seed}: {json.dumps(request)[:300]} -> {response.status_code} {response.text[:300]}"
            assert response.status_code == 200 or 400 <= response.status_code < 500, detail
            if response.status_code != 200:
                assert response.json()["error"]["message"], detail
            assert server.engine_loop.stats()["serving"], detail
    assert client_text(server, chat) == client_text(server, chat)   # still serving, deterministically


def client_text(server, chat: bool) -> str:
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0)
    with openai.OpenAI(base_url=base_url(server) + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        if chat:
            return c.chat.completions.create(messages=MESSAGES, **kwargs).choices[0].message.content
        return c.completions.create(prompt=PROMPT, **kwargs).choices[0].text


def test_admission_errors_map_to_statuses():
    full = api_error(QueueFull("queue full: 3 requests wait (max_queued_requests=3); retry later"), {})
    never = api_error(NeverFits("prompt (300 tokens) + max_tokens (200) can reach 500 tokens; the KV pool "
                                     "holds 368 per sequence"), {"prompt": "messages"})
    assert (full.status, full.code, never.status, never.param) == (429, "queue_full", 400, "messages")
    assert (api_error(Overloaded("x"), {}).status, api_error(EngineFailed("x"), {}).status) == (429, 503)


# ---- a model without a tokenizer (random weights: what the GPU serving benchmarks run) ----------------------
IDS = list(range(3, 40))
TOKEN_IDS = dict(ignore_eos=True, return_token_ids=True)


@pytest.fixture(scope="module")
def bare():
    """(server, client) over TINY_NO_EOS random weights, tokenizer None."""
    engine = LLMEngine(random_model(TINY_NO_EOS, jnp.float32), EngineConfig(precompile=False, **SERVER_KNOBS))
    assert engine.tokenizer is None
    with in_process(engine) as server, \
            openai.OpenAI(base_url=base_url(server) + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield server, c


@pytest.mark.slow
def test_token_id_prompts_without_a_tokenizer_stream_and_count_tokens(bare):
    _, client = bare
    full = client.completions.create(model=MODEL, prompt=IDS, max_tokens=9, temperature=0, logprobs=1,
                                     extra_body=TOKEN_IDS)
    choice = full.choices[0]
    assert (choice.text, choice.finish_reason, len(choice.token_ids)) == ("", "length", 9)
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(IDS), 9)
    chunks = list(client.completions.create(model=MODEL, prompt=IDS, max_tokens=9, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=TOKEN_IDS))
    assert all(ch.text == "" for c in chunks[:-1] for ch in c.choices)
    assert [t for c in chunks[:-1] for ch in c.choices for t in ch.token_ids] == choice.token_ids   # greedy
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-2].choices[0].finish_reason == "length"


BATCH = [IDS, IDS[:10], IDS[5:30]]
BATCH_FIELDS = dict(model=MODEL, prompt=BATCH, n=2, max_tokens=5, temperature=1.0, seed=5, logprobs=1,
                    extra_body=TOKEN_IDS)


@pytest.mark.slow
def test_a_list_of_prompts_is_a_choice_per_prompt_and_sample_indexed_as_openai_does(bare):
    """Choice i * n + j is prompt i's sample j, each what the prompt alone gets; usage sums the prompts."""
    _, client = bare
    full = client.completions.create(**BATCH_FIELDS)
    alone = [c for p in BATCH for c in client.completions.create(**{**BATCH_FIELDS, "prompt": p}).choices]
    assert [c.index for c in full.choices] == list(range(6))
    assert [c.token_ids for c in full.choices] == [c.token_ids for c in alone]
    assert [lp for c in full.choices for lp in c.logprobs.token_logprobs] == \
           pytest.approx([lp for c in alone for lp in c.logprobs.token_logprobs], abs=1e-4)   # batched: other shapes
    # each choice its own (samples differ in tokens, prompts in context): no two indices are interchangeable
    assert len({tuple(round(lp, 3) for lp in c.logprobs.token_logprobs) for c in full.choices}) == 6
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (sum(map(len, BATCH)), 6 * 5)


@pytest.mark.slow
def test_a_streamed_list_of_prompts_carries_each_choices_index(bare):
    _, client = bare
    full = client.completions.create(**BATCH_FIELDS)
    chunks = list(client.completions.create(**BATCH_FIELDS, stream=True, stream_options={"include_usage": True}))
    streamed: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        streamed.setdefault(choice.index, []).extend(choice.token_ids)
    assert [streamed[c.index] for c in full.choices] == [c.token_ids for c in full.choices]
    assert {c.index: c.finish_reason for ch in chunks[:-1] for c in ch.choices if c.finish_reason} == \
           {c.index: c.finish_reason for c in full.choices}
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


@pytest.mark.slow
def test_one_refused_prompt_refuses_the_list_naming_it(bare):
    server, client = bare
    before = wait_idle(server)
    too_long = error_of(client.completions.create, model=MODEL, prompt=[IDS, [5] * 600, IDS], max_tokens=4)
    assert (too_long.status_code, too_long.body["param"]) == (400, "prompt")
    assert too_long.body["message"].startswith("prompt[1] has 600 tokens"), too_long.body
    assert wait_idle(server)["engine_steps"] == before["engine_steps"]   # nothing of it ran
    no_room = error_of(client.completions.create, model=MODEL, prompt=[IDS, [5] * 500], max_tokens=20)
    assert (no_room.status_code, no_room.body["param"]) == (400, "max_tokens")
    assert no_room.body["message"].startswith("prompt[1]: max_tokens=20 with the prompt's 500 tokens"), no_room.body
    after = wait_idle(server)
    assert (after["running"], after["waiting"], after["pending"], after["kv_blocks_used"]) == (0, 0, 0, 0)
    too_many = error_of(client.completions.create, model=MODEL, prompt=[IDS] * (server.engine_loop.max_waiting + 1))
    assert (too_many.status_code, too_many.body["param"], "--max-waiting" in too_many.body["message"]) == \
           (400, "prompt", True)
    assert client.completions.create(model=MODEL, prompt=[IDS, IDS], max_tokens=2).usage.completion_tokens == 4


@pytest.mark.slow
def test_without_a_tokenizer_chat_and_text_prompts_are_400s(bare):
    server, client = bare
    chat = error_of(client.chat.completions.create, model=MODEL, messages=MESSAGES, max_tokens=4)
    text = error_of(client.completions.create, model=MODEL, prompt=PROMPT, max_tokens=4)
    assert (chat.status_code, chat.body["param"], "no tokenizer" in chat.message) == (400, "messages", True)
    assert (text.status_code, text.body["param"], "no tokenizer" in text.message) == (400, "prompt", True)
    assert server.engine_loop.stats()["serving"]


@pytest.mark.slow
def test_cache_salt_is_a_prefix_cache_namespace(bare):
    server, client = bare
    prompt = list(range(1, 100))

    def hits(salt):
        before = wait_idle(server)["prefix_cache_hits"]
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt})
        return wait_idle(server)["prefix_cache_hits"] - before
    assert (hits("a"), hits("a") > 0, hits("b"), hits("b") > 0) == (0, True, 0, True)


def throughput_lines(caplog, thread: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.threadName == thread and r.getMessage().startswith("Avg prompt throughput")]


def quiet_throughput_lines(caplog, thread: str, quiet_s: float = 1.0, timeout_s: float = 60.0) -> list[str]:
    """The server's throughput lines once a whole quiet_s (5 intervals) adds none: a loaded machine may delay the
    line of the last busy interval past a fixed sleep, and a line that never stops coming fails here."""
    deadline, lines = time.monotonic() + timeout_s, throughput_lines(caplog, thread)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        if (now := throughput_lines(caplog, thread)) == lines:
            return lines
        lines = now
    raise AssertionError(f"throughput lines kept coming for {timeout_s} s while idle: {lines[-3:]}")


@pytest.mark.slow
def test_the_log_has_a_line_per_finished_request_and_throughput_only_while_busy(monkeypatch, caplog):
    monkeypatch.setattr(engine_loop, "THROUGHPUT_INTERVAL_S", 0.2)
    caplog.set_level(logging.INFO, logger="jaxserve")
    engine = LLMEngine(random_model(TINY_NO_EOS, jnp.float32), EngineConfig(precompile=False, **SERVER_KNOBS))
    with in_process(engine) as server, \
            openai.OpenAI(base_url=base_url(server) + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        thread = loop_thread_name(server)   # servers of earlier tests in this process may still log
        time.sleep(5 * 0.2)
        idle = throughput_lines(caplog, thread)
        list(c.completions.create(model=MODEL, prompt=IDS, max_tokens=9, stream=True, extra_body={"ignore_eos": True}))
        wait_idle(server)
        busy = quiet_throughput_lines(caplog, thread)
    assert idle == []   # five idle intervals log nothing
    rates = [re.fullmatch(r"Avg prompt throughput: (\S+) tokens/s, Avg generation throughput: (\S+) tokens/s, "
                          r"Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: (\S+)%", line) for line in busy]
    assert all(rates) and any(float(r[1]) > 0 for r in rates) and any(float(r[2]) > 0 for r in rates)
    [access] = [r.getMessage() for r in caplog.records if r.name == "jaxserve.serve.metrics" and r.threadName == thread]
    assert re.fullmatch(rf"request \d+ finished: prompt_tokens={len(IDS)} output_tokens=9 ttft=\d+\.\d+s "
                        r"duration=\d+\.\d+s finish_reason=length", access), access
