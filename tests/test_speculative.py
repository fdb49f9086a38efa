"""Speculative decoding: the n-gram proposer, verification in the sampler (exact: the target distribution, and what
token-by-token decoding emits), and the engine with speculation against the engine without it."""
import dataclasses
import json
import sys

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from helpers import KNOBS, MODEL, TINY, base_url, in_process, mixed_requests
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig, SpeculativeConfig, load_run_config
from jaxserve.engine.sampler import init_penalty_state, make_sampling_tensors, sample, verify
from jaxserve.engine.sequence import Sequence, SequenceStatus
from jaxserve.engine.speculation import PROBE_EVERY, Speculator, propose_ngram
from jaxserve.models.eagle3 import load_eagle3, save_random_eagle3
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.loader import random_model, save_converted
from jaxserve.serve import jaxserve_pb2 as pb
from jaxserve.serve.jaxserve_pb2_grpc import JaxServeStub

verify_jit = jax.jit(verify, static_argnames=("num_logprobs", "mode"))
sample_jit = jax.jit(sample, static_argnames=("num_logprobs", "mode"))
SPEC = SpeculativeConfig(num_speculative_tokens=3, max_num_seqs=8)


# ---- the n-gram proposer ------------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_recurring_suffix():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [7, 1, 2, 3, 9, 9, 2, 3, 4, 5, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 1..3 (followed by 9, 9); the shorter [2, 3] also at 6..7 (followed by 4, 5)
    assert propose_ngram(tokens, 2, min_n=2, max_n=4) == [9, 9]
    assert propose_ngram(tokens, 2, min_n=2, max_n=2) == [4, 5]   # the latest occurrence of [2, 3]
    assert propose_ngram(tokens, 10, min_n=3, max_n=3) == [9, 9, 2, 3, 4, 5, 1, 2, 3]   # runs to the end
    assert propose_ngram([1, 2, 3, 4], 3, min_n=1, max_n=3) == []   # nothing recurs
    assert propose_ngram([5, 5, 5], 3, min_n=1, max_n=2) == [5]     # [5, 5] at 0..1, one token after it
    assert propose_ngram([4], 3, min_n=1, max_n=2) == []


# ---- verification ---------------------------------------------------------------------------------------------------
def run_verify(logits, params, drafts, *, gen=0, state=None, mode="sample", num_logprobs=0):
    """One row per entry of params (each its own seed), W = drafts' width + 1 positions each."""
    rows, width = len(params), drafts.shape[1] + 1
    per_position = [p for p in params for _ in range(width)]
    t = make_sampling_tensors(per_position, [s for s in range(rows) for _ in range(width)],
                              [gen + j for _ in range(rows) for j in range(width)], num_rows=rows * width)
    state = init_penalty_state(rows, logits.shape[-1]) if state is None else state
    slots = np.repeat(np.arange(rows, dtype=np.int32), width)
    return verify_jit(jnp.asarray(logits.reshape(rows * width, -1)), t, state, slots, np.ones(rows * width, bool),
                      jnp.asarray(drafts, jnp.int32), mode=mode, num_logprobs=num_logprobs)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_verification_keeps_the_target_distribution_and_accepts_with_its_probability():
    """20,000 seeds over one row of 8 tokens, 2 drafts: the first emitted token follows the target (chi-square),
    the first draft is accepted with the target's probability of it, and after it the second emitted token follows
    the second position's target. A verifier that trusted its drafts fails all three."""
    draws, rng = 20000, np.random.default_rng(0)
    row_logits = rng.standard_normal((3, 8)).astype(np.float32)
    p0, p1 = softmax(row_logits[0].astype(np.float64)), softmax(row_logits[1].astype(np.float64))
    drafts = np.tile([[int(np.argsort(p0)[-2]), int(np.argmax(p1))]], (draws, 1))
    out, _ = run_verify(np.tile(row_logits, (draws, 1, 1)), [SamplingParams(temperature=1.0)] * draws, drafts)
    tokens, accepted = np.asarray(out.tokens).reshape(draws, 3), np.asarray(out.num_accepted)
    assert stats.chisquare(np.bincount(tokens[:, 0], minlength=8), p0 * draws).pvalue > 1e-3
    rate, expected = (accepted >= 1).mean(), p0[drafts[0, 0]]
    assert abs(rate - expected) < 4 * np.sqrt(expected * (1 - expected) / draws)
    after = tokens[accepted >= 1, 1]
    assert stats.chisquare(np.bincount(after, minlength=8), p1 * len(after)).pvalue > 1e-3
    emitted_first = tokens[np.arange(draws), 0]
    assert (emitted_first[accepted == 0] != drafts[0, 0]).all()   # a rejected draft is never emitted


def test_greedy_verification_accepts_the_drafts_that_match_the_argmax():
    rng = np.random.default_rng(1)
    rows, width = 6, 4
    logits = rng.standard_normal((rows, width, 32)).astype(np.float32)
    best = logits.argmax(-1)
    drafts = best[:, :-1].copy()
    wrong_at = [0, 1, 2, None, 1, None]   # None: every draft right
    for r, j in enumerate(wrong_at):
        if j is not None:
            drafts[r, j] = (drafts[r, j] + 1) % 32
    drafts[5, 2] = -1   # row 5 has two drafts only
    out, state = run_verify(logits, [SamplingParams(temperature=0.0)] * rows, drafts, mode="greedy")
    accepted = np.asarray(out.num_accepted)
    np.testing.assert_array_equal(accepted, [0, 1, 2, 3, 1, 2])
    tokens = np.asarray(out.tokens).reshape(rows, width)
    np.testing.assert_array_equal(tokens, best)   # each position's draw is the target's own
    counts = np.asarray(state.output_counts)
    assert [counts[r].sum() for r in range(rows)] == list(accepted + 1)   # only emitted tokens are counted


def test_verification_with_penalties_and_min_tokens_draws_what_token_by_token_sampling_draws():
    """Drafts that are exactly what sampling one token at a time produces (penalties counting each sampled token,
    EOS suppressed under min_tokens, the noise at each gen_index) are all accepted, and the same next token follows."""
    rng = np.random.default_rng(2)
    vocab, width, eos = 16, 4, 3
    logits = (rng.standard_normal((width, vocab)) * 2).astype(np.float32)
    logits[:, eos] += 4.0   # EOS would win without min_tokens
    params = SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3,
                            min_tokens=3, seed=5)
    state = init_penalty_state(1, vocab)
    state.output_counts = state.output_counts.at[0, 7].set(2)   # generated before this step
    gen, step_state, sequential = 1, state, []
    for j in range(width):
        t = make_sampling_tensors([params], [9], [gen + j], num_rows=1, eos_token_ids=[eos])
        out, step_state = sample_jit(jnp.asarray(logits[j:j + 1]), t, step_state, np.zeros(1, np.int32),
                                     np.ones(1, bool), mode="sample")
        sequential.append(int(out.tokens[0]))
    assert eos not in sequential[:2]   # suppressed while fewer than min_tokens were generated
    rows_t = make_sampling_tensors([params] * width, [9] * width, [gen + j for j in range(width)], num_rows=width,
                                   eos_token_ids=[eos])
    out, verified_state = verify_jit(jnp.asarray(logits), rows_t, state, np.zeros(width, np.int32),
                                     np.ones(width, bool), jnp.asarray([sequential[:-1]], jnp.int32), mode="sample")
    assert int(out.num_accepted[0]) == width - 1
    assert np.asarray(out.tokens).tolist() == sequential
    np.testing.assert_array_equal(verified_state.output_counts, step_state.output_counts)


# ---- the engine ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    return random_model(TINY, jnp.float32)


@pytest.fixture(scope="module")
def plain(tiny_model):
    return LLM(tiny_model, **KNOBS, num_blocks=256)


@pytest.fixture(scope="module")
def spec(tiny_model):
    """Few blocks: the mixed requests preempt one another."""
    return LLM(tiny_model, **KNOBS, num_blocks=16, speculative_config=SPEC)


@pytest.fixture
def always(spec, monkeypatch):
    """The spec engine speculates in every step it may, whatever its timings say (they are the policy's tests)."""
    monkeypatch.setattr(spec.engine.speculator, "choose", lambda bucket: True)
    return spec


def outputs(llm, prompts, params):
    return {(tuple(p), c.index): c for p, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False))
            for c in o.outputs}


class Oracle:
    """Drafts from the continuation that decoding without speculation gave, every third one wrong: speculation is
    exercised accepting and rejecting drafts of every kind of request."""

    def __init__(self, reference: dict, vocab_size: int):
        self.reference, self.vocab_size = reference, vocab_size

    def __call__(self, seq: Sequence, num_drafts: int) -> list[int]:
        ref = self.reference[(tuple(seq.token_ids[:seq.num_prompt_tokens]), seq.index)].token_ids
        done = seq.num_output_tokens
        drafts = list(ref[done:done + num_drafts])
        return [(t + 1) % self.vocab_size if (done + j) % 3 == 2 else t for j, t in enumerate(drafts)]


def check_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, c in expected.items():
        assert got[key].token_ids == c.token_ids, key
        assert got[key].finish_reason == c.finish_reason
        if c.logprobs is not None:   # the same logits through another graph (rows of several queries): f32 rounding
            for a, b in zip(got[key].logprobs, c.logprobs):
                assert a.keys() == b.keys()
                np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_every_kind_of_request_decodes_the_same_with_right_and_wrong_drafts(plain, always, monkeypatch):
    """Greedy, sampled, penalties, logprobs, prompt logprobs, n = 3, stop ids under min_tokens, a chunked prompt:
    token-identical to speculation off, preempted for lack of blocks on the way (six long outputs beside them), every
    block back at the end."""
    prompts, params = mixed_requests()
    prompts += [[5 + i] * 20 for i in range(6)]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True) for i in range(6)]
    expected = outputs(plain, prompts, params)
    engine = always.engine
    monkeypatch.setattr(engine.speculator, "draft", Oracle(expected, TINY.vocab_size))
    before = dict(engine.stats())
    check_same(outputs(always, prompts, params), expected)
    after = engine.stats()
    drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert 0 < accepted < drafted
    assert after["preemptions"] > before["preemptions"]
    assert after["compiles_after_start"] == 0
    engine.step()
    assert after["kv_blocks_free"] == after["kv_blocks_total"]


def test_ngram_speculation_on_repetitive_text(plain, always):
    prompts = [[5, 6, 7, 8, 9] * 6, [10, 11, 12] * 8 + [13], [20, 21, 22, 23] * 5]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, repetition_penalty=1.2, seed=4, max_tokens=40, logprobs=2)]
    before = always.engine.stats()["spec_num_accepted_tokens"]
    check_same(outputs(always, prompts, params), outputs(plain, prompts, params))
    assert always.engine.stats()["spec_num_accepted_tokens"] > before


def test_prefix_cache_holds_only_verified_tokens(plain, always, monkeypatch):
    """After drafts were written and mostly rejected, the conversation so far (prompt + verified output) as a new
    prompt hits the prefix cache and continues as an engine that never cached does: a block hashed with a rejected
    draft's KV in it would change the continuation."""
    prompt = [2 + (i * 5) % 100 for i in range(40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    first = outputs(plain, [prompt], [greedy])
    monkeypatch.setattr(always.engine.speculator, "draft", Oracle(first, TINY.vocab_size))
    check_same(outputs(always, [prompt], [greedy]), first)
    conversation = prompt + first[(tuple(prompt), 0)].token_ids
    hits = always.engine.kv.prefix_cache_hits
    monkeypatch.setattr(always.engine.speculator, "draft", lambda seq, k: [])
    check_same(outputs(always, [conversation], [greedy]), outputs(plain, [conversation], [greedy]))
    assert always.engine.kv.prefix_cache_hits - hits >= 64


def test_large_steps_do_not_speculate(tiny_model, monkeypatch):
    """More decoding sequences than speculative_config.max_num_seqs: those steps carry no drafts."""
    llm = LLM(tiny_model, **KNOBS, num_blocks=128, precompile=False,
              speculative_config=dataclasses.replace(SPEC, max_num_seqs=2))
    proposed = []
    monkeypatch.setattr(llm.engine.speculator, "draft", lambda seq, k: proposed.append(seq.seq_id) or [4] * k)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt in ([3, 4, 5], [6, 7], [8, 9, 10, 11]):
        llm.engine.add_request(prompt, params)
    llm.engine.step()   # the three prompts' prefill
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert not proposed
    llm.generate([[3, 4, 5]], params, use_tqdm=False)
    assert proposed   # one sequence alone speculates


def test_each_bucket_speculates_the_way_measured_faster_and_tries_the_other_now_and_then():
    speculator = Speculator(SpeculativeConfig(max_num_seqs=8), max_model_len=64, seq_buckets=(1, 8))
    assert speculator.choose(1)                           # nothing measured: speculation first
    speculator.observe(1, True, seconds=0.030, num_tokens=3)
    assert not speculator.choose(1)                       # then without
    speculator.observe(1, False, seconds=0.020, num_tokens=1)
    picks = [speculator.choose(1) for _ in range(2 * PROBE_EVERY)]
    assert picks.count(True) == 2 * PROBE_EVERY - 2       # 10 ms a token beats 20, but for the probes
    for _ in range(20):                                   # acceptance falls: 3 tokens a step become 1
        speculator.observe(1, True, seconds=0.030, num_tokens=1)
    picks = [speculator.choose(1) for _ in range(2 * PROBE_EVERY)]
    assert picks.count(True) == 2
    speculator.observe(5, True, seconds=0.5, num_tokens=1)   # bucket 8's estimate, not bucket 1's
    assert speculator.seconds_per_token[(8, True)] == 0.5 and speculator.choose(8) is False
    speculator.observe(9, True, seconds=0.5, num_tokens=1)   # past max_num_seqs: no bucket
    assert (16, True) not in speculator.seconds_per_token


def test_the_engine_times_its_decode_steps_for_the_speculator(tiny_model, monkeypatch):
    llm = LLM(tiny_model, **KNOBS, num_blocks=128, precompile=False, speculative_config=SPEC)
    seen, observe = [], llm.engine.speculator.observe
    monkeypatch.setattr(llm.engine.speculator, "observe", lambda *args: seen.append(args) or observe(*args))
    monkeypatch.setattr(llm.engine.speculator, "draft", lambda seq, k: [4] * k)
    llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert seen and all(n == 1 and seconds > 0 for n, _, seconds, _ in seen)   # one sequence decoding
    assert {way for _, way, _, _ in seen} == {True, False}   # both ways measured
    assert sum(tokens for *_, tokens in seen) <= 12


def test_structured_outputs_and_the_batch_decide_which_steps_speculate():
    speculator = Speculator(SpeculativeConfig(max_num_seqs=2), max_model_len=64, seq_buckets=(2,))
    assert speculator.wants(2, constrained=False)
    assert not speculator.wants(3, constrained=False)   # more decoding than max_num_seqs
    assert not speculator.wants(0, constrained=False)   # prefills only
    assert not speculator.wants(1, constrained=True)    # a mask per token: no drafts


def test_drafts_stop_at_max_tokens_and_max_model_len():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1), max_model_len=12,
                            seq_buckets=(1,))
    s = Sequence(0, "r", 0, [1, 2, 3, 4, 5, 6, 1], 5, SamplingParams(max_tokens=4), 0,
                 status=SequenceStatus.RUNNING, num_computed_tokens=6)
    speculator.propose([s])
    assert s.draft_ids == [2]   # 2 outputs so far, max_tokens 4: this step's token and one draft
    s.params = SamplingParams(max_tokens=100)
    speculator.propose([s])
    assert s.draft_ids == [2, 3, 4, 5]   # num_speculative_tokens
    s.token_ids += [2, 3, 4]
    s.num_computed_tokens = 9
    speculator.propose([s])
    assert s.draft_ids == [5]   # 12 - 10 tokens - this step's token


def test_a_server_speculates_and_reports_acceptance_in_its_metrics(plain, spec, monkeypatch):
    """OpenAI HTTP on a speculating engine: the completion is speculation off's, and /metrics and gRPC's
    ServerStats count its drafts."""
    import json
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    prompt, params = [5, 6, 7, 8, 9] * 6, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = outputs(plain, [prompt], [params])
    monkeypatch.setattr(spec.engine.speculator, "draft", Oracle(expected, TINY.vocab_size))
    spec.engine.speculator.seconds_per_token.clear()   # unmeasured: the first decode step speculates
    before = spec.engine.stats()["spec_num_accepted_tokens"]
    with in_process(spec.engine) as server:
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                           "return_token_ids": True}).encode()
        request = urllib.request.Request(base_url(server) + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            choice = json.load(response)["choices"][0]
        text = urllib.request.urlopen(base_url(server) + "/metrics", timeout=10).read().decode()
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            server_stats = JaxServeStub(channel).ServerStats(pb.ServerStatsRequest(), timeout=10)
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert choice["token_ids"] == expected[(tuple(prompt), 0)].token_ids
    accepted = samples["jaxserve_spec_decode_num_accepted_tokens_total"]
    assert samples["jaxserve_spec_decode_num_draft_tokens_total"] >= accepted > before
    assert samples["jaxserve_spec_decode_mean_acceptance_length"] > 1
    assert (server_stats.spec_num_accepted_tokens, server_stats.spec_num_draft_tokens) == (
        accepted, samples["jaxserve_spec_decode_num_draft_tokens_total"])
    assert server_stats.spec_num_drafts > 0 and server_stats.spec_mean_acceptance_length > 1


# ---- the draft model ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def self_draft(tiny_model, tmp_path_factory):
    """The model as its own draft: every greedy draft is what the model decodes, unless the draft's KV (its layers
    of the cache) were missing or stale. Few blocks: requests preempt one another."""
    path = save_converted(tiny_model, tmp_path_factory.mktemp("draft") / "copy")
    llm = LLM(tiny_model, **KNOBS, num_blocks=16,
              speculative_config=dataclasses.replace(SPEC, method="draft", model=str(path)))
    llm.engine.speculator.choose = lambda bucket: True   # every step it may, whatever its timings say
    return llm


@pytest.fixture(scope="module")
def small_draft(tiny_model, tmp_path_factory):
    """A draft of other shapes than the model's (one layer, one kv head of 32): its KV layers differ in the cache."""
    cfg = dataclasses.replace(TINY, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                              head_dim=32)
    path = save_converted(random_model(cfg, jnp.float32, seed=1), tmp_path_factory.mktemp("draft") / "small")
    llm = LLM(tiny_model, **KNOBS, num_blocks=16,
              speculative_config=dataclasses.replace(SPEC, method="draft", model=str(path)))
    llm.engine.speculator.choose = lambda bucket: True
    return llm


def drafted_and_accepted(llm, run) -> tuple[int, int]:
    before = llm.engine.stats()
    run()
    after = llm.engine.stats()
    return tuple(after[k] - before[k] for k in ("spec_num_draft_tokens", "spec_num_accepted_tokens"))


@pytest.mark.slow
def test_the_model_as_its_own_draft_has_every_draft_accepted(plain, self_draft):
    """Greedy requests through chunked prefill, preemption (recomputed KV), prefix-cache hits (blocks another
    request computed) and n = 3 (forked blocks, copy-on-write): token-identical to speculation off and every draft
    accepted, so the draft's KV of every token was there and right; every block back at the end."""
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    shared = [2 + (i * 7) % 100 for i in range(40)]
    prompts = [[5 + i] * 20 for i in range(4)] + [shared, shared + [3], list(range(2, 90))]
    params = [greedy] * 6 + [dataclasses.replace(greedy, n=3)]
    expected = outputs(plain, prompts, params)
    hits, engine = self_draft.engine.kv.prefix_cache_hits, self_draft.engine
    drafted, accepted = drafted_and_accepted(self_draft, lambda: check_same(outputs(self_draft, prompts, params),
                                                                            expected))
    assert drafted > 50 and accepted == drafted
    stats = engine.stats()
    assert stats["preemptions"] > 0 and engine.kv.prefix_cache_hits > hits
    assert stats["compiles_after_start"] == 0
    engine.step()
    assert engine.stats()["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.slow
def test_every_kind_of_request_decodes_the_same_with_a_draft_model_of_other_shapes(plain, small_draft):
    prompts, params = mixed_requests()
    prompts += [[5 + i] * 20 for i in range(6)]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True) for i in range(6)]
    expected = outputs(plain, prompts, params)
    drafted, _ = drafted_and_accepted(small_draft, lambda: check_same(outputs(small_draft, prompts, params),
                                                                      expected))
    assert drafted > 0
    assert small_draft.engine.stats()["compiles_after_start"] == 0


def test_steps_too_large_to_speculate_skip_the_draft_and_change_no_output(plain, tiny_model, tmp_path):
    """max_num_seqs 2: the steps of six sequences run no draft (holes in its cache), the outputs are still speculation
    off's; a sequence computed in small steps alone has every draft accepted again."""
    path = save_converted(tiny_model, tmp_path / "copy")
    llm = LLM(tiny_model, **KNOBS, num_blocks=64, precompile=False, speculative_config=dataclasses.replace(
        SPEC, method="draft", model=str(path), max_num_seqs=2))
    llm.engine.speculator.choose = lambda bucket: True
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[5 + i, 9, 3 + i] for i in range(6)]
    check_same(outputs(llm, prompts, [greedy] * 6), outputs(plain, prompts, [greedy] * 6))
    drafted, accepted = drafted_and_accepted(llm, lambda: llm.generate([[40, 41]], greedy, use_tqdm=False))
    assert drafted > 0 and accepted == drafted
    graphs = llm.engine.graphs   # a graph without the draft takes only the model's cache layers (no pass-through)
    big, small = (graphs.model_key(rows, rows, True) for rows in (6, 1))
    cache_arrays = lambda key: len(jax.tree.leaves(graphs.lower(key).args_info[0][1]))
    assert (cache_arrays(big), cache_arrays(small)) == (2 * TINY.num_layers, 4 * TINY.num_layers)


def test_a_draft_model_must_share_the_tokenizer(tiny_model, tmp_path):
    bigger = save_converted(random_model(dataclasses.replace(TINY, vocab_size=256), jnp.float32), tmp_path / "big")
    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the model 128: a draft model must share"):
        LLM(tiny_model, **KNOBS, num_blocks=16, precompile=False,
            speculative_config={"method": "draft", "model": str(bigger)})


# ---- EAGLE-3 heads -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory):
    """A random head for TINY in the published layout: a draft vocabulary of 64 of its 128 tokens, features from the
    hidden states entering layers 0, 1 and 1 (TINY has two)."""
    return save_random_eagle3(tmp_path_factory.mktemp("eagle3") / "head", TINY, draft_vocab_size=64,
                              aux_layers=(0, 1, 1), std=0.2)


def eagle_engine(tiny_model, path, **knobs):
    llm = LLM(tiny_model, **{**KNOBS, "num_blocks": 16, **knobs},
              speculative_config=dataclasses.replace(SPEC, method="eagle3", model=str(path)))
    llm.engine.speculator.choose = lambda bucket: True   # every step it may, whatever its timings say
    return llm


REFERENCE_LEN = 160   # every recorded sequence with its drafts fits: the dense reference compiles once


def reference_drafts(target, head, tokens: list[int], num_drafts: int) -> tuple[list[int], list[float]]:
    """The head's greedy drafts after `tokens`, dense (no cache, no paging): entries (t[p + 1], fc(target's hidden
    states entering its aux layers at p)) for p < len - 1, each draft appended with the head's output as its
    features; and each draft's top-2 logit margin."""
    assert len(tokens) + num_drafts <= REFERENCE_LEN
    ids = jnp.zeros(REFERENCE_LEN, jnp.int32).at[:len(tokens)].set(jnp.asarray(tokens, jnp.int32))
    drafts, margins = padded_reference_drafts(target, head, ids, len(tokens), num_drafts)
    return [int(d) for d in drafts], [float(m) for m in margins]


@nnx.jit(static_argnames="num_drafts")
def padded_reference_drafts(target, head, ids, length, num_drafts: int):
    """reference_drafts over ids padded to one length (a shape per draft count, not per sequence): attention is
    causal, so no position before `length` sees the padding, whose entries and features are overwritten as the
    drafts arrive."""
    positions = jnp.arange(ids.shape[0])
    _, _, aux = target.forward(ids, positions, aux_layers=head.aux_layers)
    features, entries = head.features(aux), jnp.roll(ids, -1)   # entry p: (t[p + 1], features at p)
    drafts, margins = [], []
    for i in range(num_drafts):
        last = length - 2 + i   # the last live entry
        out = jax.lax.dynamic_slice_in_dim(head(entries, features, positions)[0], last, 1)
        top2 = jax.lax.top_k(head.lm_head(head.norm(out))[0], 2)[0]
        drafts.append(head.propose(out)[0])
        margins.append(top2[0] - top2[1])
        entries = entries.at[last + 1].set(drafts[-1])
        features = jax.lax.dynamic_update_slice_in_dim(features, out.astype(features.dtype), last + 1, 0)
    return jnp.stack(drafts), jnp.stack(margins)


@pytest.mark.slow
def test_eagle3_drafts_are_the_heads_own_through_chunked_prefill_and_verify_steps(tiny_model, eagle_dir):
    """Every draft of a greedy request (its prompt in chunks, then verify steps accepting 0 or more drafts) is what
    the head computes densely from the whole sequence: its cache entries of every position and the features
    passed from step to step are there and right. Drafts whose top-2 logits lie within f32 rounding are not
    compared (nor the rest of that step's)."""
    llm = eagle_engine(tiny_model, eagle_dir, num_blocks=64)
    runner, events = llm.engine.runner, []
    draft = runner.draft

    def recording(rows):
        draft(rows)
        events.extend((list(r.seq.token_ids[:r.start + 1]), r.draft_ids) for r in rows if r.draft_ids)
    runner.draft = recording
    prompt = [2 + (i * 37) % 120 for i in range(100)]   # 100 tokens: chunks of at most 64
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    head = runner.graphs.draft_def.merge(runner.params)
    compared = 0
    for tokens, drafts in events:
        expected, margins = reference_drafts(tiny_model.model, head, tokens, len(drafts))
        for got, want, margin in zip(drafts, expected, margins):
            if margin < 1e-4:   # f32 sums in another order (paged vs dense): ~1e-6 apart
                break
            assert got == want, (len(tokens), drafts, expected)
            compared += 1
    assert len(events) > 5 and compared > 0.8 * sum(len(d) for _, d in events)


@pytest.mark.slow
def test_every_kind_of_request_decodes_the_same_with_an_eagle3_head(plain, tiny_model, eagle_dir):
    """Greedy, sampled, penalties, logprobs, n = 3, chunked prompts, preempted for lack of blocks: speculation
    off's tokens, 0 compiles after start, every block back."""
    prompts, params = mixed_requests()
    prompts += [[5 + i] * 20 for i in range(6)]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True) for i in range(6)]
    expected = outputs(plain, prompts, params)
    llm = eagle_engine(tiny_model, eagle_dir)
    drafted, _ = drafted_and_accepted(llm, lambda: check_same(outputs(llm, prompts, params), expected))
    stats = llm.engine.stats()
    assert drafted > 0 and stats["preemptions"] > 0 and stats["compiles_after_start"] == 0
    llm.engine.step()
    assert llm.engine.stats()["kv_blocks_free"] == stats["kv_blocks_total"]


def test_an_eagle3_head_loads_in_the_published_layout(tiny_model, tmp_path):
    """Without its own embeddings the head shares the model's table (one array); with them, its own. d2t maps the
    draft vocabulary into the model's; a PyTorch .bin checkpoint loads as the safetensors one does."""
    import torch
    from safetensors.numpy import load_file
    shared = load_eagle3(save_random_eagle3(tmp_path / "shared", TINY, draft_vocab_size=64, aux_layers=(0, 1, 1)),
                         tiny_model)
    head = shared.model
    assert head.embed_tokens.embedding[...] is tiny_model.model.embed_tokens.embedding[...]
    assert head.aux_layers == (0, 1, 1) and shared.config.num_layers == 1
    stored = load_file(str(tmp_path / "shared" / "model.safetensors"))
    ids = np.arange(64) + np.asarray(head.d2t[...])
    np.testing.assert_array_equal(np.flatnonzero(stored["t2d"]), ids)   # d2t and t2d agree, as published
    np.testing.assert_array_equal(np.asarray(head.midlayer.self_attn.q_proj.kernel[...]),
                                  stored["midlayer.self_attn.q_proj.weight"].T)
    own = save_random_eagle3(tmp_path / "own", TINY, draft_vocab_size=64, aux_layers=(0, 1, 1), with_embeddings=True)
    np.testing.assert_array_equal(np.asarray(load_eagle3(own, tiny_model).model.embed_tokens.embedding[...]),
                                  load_file(str(own / "model.safetensors"))["embed_tokens.weight"])
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "shared" / "config.json").read_text())
    torch.save({k: torch.from_numpy(v) for k, v in stored.items()}, tmp_path / "bin" / "pytorch_model.bin")
    from_bin = load_eagle3(tmp_path / "bin", tiny_model).model
    for a, b in zip(jax.tree.leaves(nnx.state(from_bin)), jax.tree.leaves(nnx.state(head))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def numpy_eagle3_layer(head, tokens: np.ndarray, features: np.ndarray, norm_before_residual: bool) -> np.ndarray:
    """The published EAGLE-3 step in numpy, from the head's weights: [embed(t) normed, features normed] -> causal
    GQA attention with rope (HF's rotate-half) -> + features (or, norm_before_residual, the normed features) ->
    + MLP(post-attention norm); then the final norm and the draft LM head -> target ids through d2t."""
    w = lambda m: np.asarray(m.kernel[...], np.float64)
    rms = lambda x, g: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * np.asarray(g.weight[...])
    layer, attn = head.midlayer, head.midlayer.self_attn
    cfg = attn.cfg
    normed = rms(features, layer.hidden_norm)
    x = np.concatenate([rms(np.asarray(head.embed_tokens.embedding[...])[tokens], layer.input_layernorm), normed], -1)
    t, d = len(tokens), cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None]
    def rope(v):
        v1, v2 = v[..., :d // 2], v[..., d // 2:]
        c, s_ = np.cos(ang)[:, None], np.sin(ang)[:, None]
        return np.concatenate([v1 * c - v2 * s_, v2 * c + v1 * s_], -1)
    q = rope((x @ w(attn.q_proj)).reshape(t, cfg.num_heads, d))
    k = rope((x @ w(attn.k_proj)).reshape(t, cfg.num_kv_heads, d))
    v = (x @ w(attn.v_proj)).reshape(t, cfg.num_kv_heads, d)
    k, v = (np.repeat(a, cfg.num_heads // cfg.num_kv_heads, axis=1) for a in (k, v))
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + np.triu(np.full((t, t), -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    out = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v).reshape(t, -1) @ w(attn.o_proj)
    h = (normed if norm_before_residual else features) + out
    m = rms(h, layer.post_attention_layernorm)
    gate = m @ w(layer.mlp.gate_proj)
    y = h + (gate / (1 + np.exp(-gate)) * (m @ w(layer.mlp.up_proj))) @ w(layer.mlp.down_proj)
    draft = (rms(y, head.norm) @ w(head.lm_head)).argmax(-1)
    return y, draft + np.asarray(head.d2t[...])[draft]


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_the_eagle3_layer_is_the_published_one(tiny_model, tmp_path, norm_before_residual):
    """The head's step (dense, f32) against the published layer written out in numpy (f64) on the same weights; the
    config's eagle_config nesting and norm_before_residual are read."""
    path = save_random_eagle3(tmp_path / "head", TINY, draft_vocab_size=64, std=0.2)
    config = json.loads((path / "config.json").read_text())
    config.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 0, 1]},
                  norm_before_residual=norm_before_residual)
    (path / "config.json").write_text(json.dumps(config))
    head = load_eagle3(path, tiny_model).model
    assert head.aux_layers == (1, 0, 1)
    rng = np.random.default_rng(3)
    tokens, features = rng.integers(0, TINY.vocab_size, 12), rng.standard_normal((12, TINY.hidden_size))
    with jax.default_matmul_precision("highest"):   # a GPU's f32 dots default to TF32 (~1e-3)
        out, _ = head(jnp.asarray(tokens), jnp.asarray(features, jnp.float32), jnp.arange(12))
        drafts = head.propose(out)
    want, want_drafts = numpy_eagle3_layer(head, tokens, features, norm_before_residual)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)   # f32 against f64, values ~1
    np.testing.assert_array_equal(np.asarray(drafts), want_drafts)


def test_an_eagle3_head_must_fit_its_model(tiny_model, tmp_path):
    other = save_random_eagle3(tmp_path / "vocab", dataclasses.replace(TINY, vocab_size=256), aux_layers=(0, 1, 1))
    with pytest.raises(ModelLoadError, match="vocab_size 256 is not the model's 128"):
        load_eagle3(other, tiny_model)
    with pytest.raises(ModelLoadError, match="must be 3 of 0..1, got \\[2, 1, -1\\]"):   # TINY: too few layers
        load_eagle3(save_random_eagle3(tmp_path / "aux", TINY), tiny_model)
    wide = save_random_eagle3(tmp_path / "wide", dataclasses.replace(TINY, hidden_size=32), hidden_size=64,
                              num_heads=4, num_kv_heads=2, aux_layers=(0, 1, 1))
    with pytest.raises(ModelLoadError, match="target_hidden_size 32 is not the model's hidden size 64"):
        load_eagle3(wide, tiny_model)
    config = json.loads((wide / "config.json").read_text())
    del config["target_hidden_size"]   # then the weights tell
    (wide / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="fc.weight \\(96, 64\\) does not fit the model \\(expected \\(192, 64\\)"):
        load_eagle3(wide, tiny_model)


@pytest.mark.slow
def test_smollm_eagle3_head_of_its_shapes_is_greedy_identical(smollm, tmp_path):
    """A random head of the shapes an EAGLE-3 head of SmolLM2 takes (its widths, 9 q / 3 kv heads, a draft vocabulary
    of 8,192 of 49,152 tokens, features from layers 2, 15 and 27 of 30) loads and changes no greedy token."""
    path = save_random_eagle3(tmp_path / "head", smollm.config, draft_vocab_size=8192)
    knobs = dict(max_num_seqs=4, max_num_batched_tokens=128, num_blocks=64, compile_cache_dir=None, precompile=False)
    prompts = [smollm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                    add_generation_prompt=True)
               for q in ("What is the capital of France?", "Write a haiku about the sea.")]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    expected = [o.outputs[0].token_ids for o in LLM(smollm, **knobs).generate(prompts, params, use_tqdm=False)]
    llm = LLM(smollm, **knobs, speculative_config=SpeculativeConfig(method="eagle3", model=str(path)))
    llm.engine.speculator.choose = lambda bucket: True
    assert llm.engine.graphs.draft_def.merge(llm.engine.runner.params).aux_layers == (2, 15, 27)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


# ---- configuration ------------------------------------------------------------------------------------------------
def test_speculative_config_from_a_file_and_its_errors(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("engine:\n  speculative_config:\n    method: ngram\n    num_speculative_tokens: 5\n")
    assert load_run_config(path).engine.speculative_config == SpeculativeConfig(num_speculative_tokens=5)
    path.write_text("engine:\n  speculative_config:\n    method: ngram\n    draft_tokens: 5\n")
    with pytest.raises(ValueError, match="speculative_config: unknown keys \\['draft_tokens'\\]"):
        load_run_config(path)
    with pytest.raises(ValueError, match="speculative_config.method must be one of"):
        EngineConfig(speculative_config={"method": "medusa"})
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens must be a positive int"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0})
    for bad in ({"method": "draft"}, {"method": "eagle3"}, {"model": "x"}, {"method": "draft", "model": ""}):
        with pytest.raises(ValueError, match="speculative_config.model"):
            EngineConfig(speculative_config=bad)
    with pytest.raises(ValueError, match="kv_backend must be paged with speculative_config"):
        EngineConfig(speculative_config={}, kv_backend="vattention", enable_prefix_caching=False)


def test_speculative_flags(tmp_path):
    from jaxserve.cli import build_parser, served_engine_config
    parse = build_parser().parse_args
    assert served_engine_config(parse(["serve"])).speculative_config is None
    cfg = served_engine_config(parse(["serve", "--speculative-method", "ngram", "--num-speculative-tokens", "6"]))
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=6)
    path = tmp_path / "run.yaml"
    path.write_text("engine:\n  speculative_config: {prompt_lookup_max: 3}\n")
    cfg = served_engine_config(parse(["serve", "--config", str(path), "--num-speculative-tokens", "2"]))
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3)
    cfg = served_engine_config(parse(["serve", "--speculative-method", "draft", "--speculative-model", "small"]))
    assert cfg.speculative_config == SpeculativeConfig(method="draft", model="small")
    cfg = served_engine_config(parse(["serve", "--speculative-method", "eagle3", "--speculative-model", "head"]))
    assert cfg.speculative_config == SpeculativeConfig(method="eagle3", model="head")
    for flags in (["--num-speculative-tokens", "2"], ["--speculative-model", "small"]):
        with pytest.raises(ValueError, match="need --speculative-method"):
            served_engine_config(parse(["serve", *flags]))


# ---- the embedded model ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm_ngram_speculation_is_greedy_identical_and_accepts(smollm):
    """An input-grounded prompt (rewrite a given text) on SmolLM2: n-gram drafts from the text are accepted, and the
    output is the output without speculation."""
    text = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, the "
            "members agreed to increase funding for children's books and to extend the opening hours on weekends.")
    prompt = smollm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}], tokenize=False,
        add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    knobs = dict(max_num_seqs=4, max_num_batched_tokens=128, num_blocks=64, compile_cache_dir=None, precompile=False)
    expected = LLM(smollm, **knobs).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(smollm, **knobs, speculative_config=SpeculativeConfig(num_speculative_tokens=4))
    llm.engine.speculator.choose = lambda bucket: True   # every step it may, whatever its timings say
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    assert llm.engine.stats()["spec_mean_acceptance_length"] > 2.0
    print(f"mean acceptance length {llm.engine.stats()['spec_mean_acceptance_length']:.2f}", file=sys.stderr)
