"""The bucket sweep's machinery on a tiny random model: synthetic batches are what the engine would build,
rows carry the fields the results format needs, the ladder analysis prices padding consistently (CPU, no timing
assertions)."""
import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.common import Bytes, write_rows
from benchmarks.sweep import (SWEEP_SAMPLING, SweepCase, Traffic, assign_blocks, case_layout, ladder_candidates,
                              ladder_rows, pad_to, padding_waste, run_sweep, simulate_steps, step_cost,
                              synthetic_inputs)
from jaxserve.cli import main as cli_main
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import start_device
from jaxserve.engine.scheduler import StepRow
from jaxserve.engine.sequence import Sequence
from jaxserve.models.attention import AttentionKernels
from jaxserve.models.loader import random_model

from helpers import TINY_NO_EOS as TINY

CFG = EngineConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, min_prefill_chunk=16,
                   token_buckets=(16, 32, 64), seq_buckets=(4, 8), num_blocks=160, precompile=False)
ROW_FIELDS = {"bench", "impl", "params", "ms", "tok_s", "compile_s", "bytes", "flops", "roofline_frac"}


@pytest.fixture(scope="module")
def tiny():
    return random_model(TINY, jnp.float32)


@pytest.fixture(scope="module")
def runner(tiny):
    return start_device(tiny, CFG)[1]


def engine_inputs(runner, syn):
    """The engine's own prepare_inputs for the rows a synthetic batch describes (same tokens, blocks, seeds)."""
    n, bs = int(syn.model.attn.num_seqs[0]), runner.cfg.block_size
    cu, kv_lens = syn.model.attn.cu_q_lens, syn.model.attn.kv_lens
    rows = []
    for i in range(n):
        count = int(cu[i + 1] - cu[i])
        tokens = np.zeros(kv_lens[i], np.int32)
        tokens[kv_lens[i] - count:] = syn.model.token_ids[cu[i]:cu[i + 1]]
        seq = Sequence(i, str(i), 0, tokens.tolist(), int(kv_lens[i]), SWEEP_SAMPLING, seed=i)
        runner.slot_of[i] = i
        runner.block_table.write(i, 0, syn.model.attn.block_tables[i, :-(-kv_lens[i] // bs)].tolist())
        rows.append(StepRow(seq, int(kv_lens[i]) - count, count, samples=True, num_generated=0))
    return runner.prepare_inputs(rows)


@pytest.mark.parametrize("case", [SweepCase(8, 8, 40, "decode"), SweepCase(4, 4, 200, "decode"),
                                  SweepCase(32, 8, 40, "mixed"), SweepCase(64, 4, 20, "mixed")], ids=str)
def test_synthetic_inputs_are_what_the_engine_builds(runner, case):
    syn = synthetic_inputs(runner, case, np.random.default_rng(0))
    n = int(syn.model.attn.num_seqs[0])
    try:
        eng = engine_inputs(runner, syn)
        assert (eng.model.key, eng.sampler.key) == (syn.model.key, syn.sampler.key)
        jax.tree.map(np.testing.assert_array_equal, (eng.model, eng.sampler), (syn.model, syn.sampler))
        out_eng = jax.tree.map(np.asarray, runner.run(eng)[0])
        out_syn = jax.tree.map(np.asarray, runner.run(syn)[0])
    finally:
        for i in range(n):
            runner.block_table.clear_row(i)
        runner.slot_of.clear()
    assert np.isfinite(out_syn.logprob[:n]).all()
    np.testing.assert_array_equal(out_syn.tokens[:n], out_eng.tokens[:n])
    np.testing.assert_array_equal(out_syn.logprob[:n], out_eng.logprob[:n])


def test_decode_cases_run_the_engines_decode_graph(tiny, monkeypatch):
    """Where a decode kernel runs (the GPU), a decode case is timed on the decode-only graph the engine runs."""
    import jaxserve.engine.step_graphs as step_graphs
    monkeypatch.setattr(step_graphs, "resolve_attention_kernels", lambda *_: AttentionKernels("pallas", "triton"))
    r, rng = start_device(tiny, CFG)[1], np.random.default_rng(0)
    assert synthetic_inputs(r, SweepCase(16, 8, 40, "decode"), rng).model.attn.decode_only
    assert not synthetic_inputs(r, SweepCase(32, 8, 40, "mixed"), rng).model.attn.decode_only


def test_padded_decode_bucket_is_consistent(runner):
    """A bucket the engine would not pick for the batch (8 decodes in 64 tokens) is still a valid batch."""
    case = SweepCase(64, 8, 100, "decode")
    syn = synthetic_inputs(runner, case, np.random.default_rng(1))
    a, bs = syn.model.attn, runner.cfg.block_size
    assert int(a.num_seqs[0]) == 8 and (a.kv_lens == 100).all() and (np.diff(a.cu_q_lens) == 1).all()
    assert (syn.model.positions[:8] == 99).all() and (syn.model.positions[8:] == 0).all()
    np.testing.assert_array_equal(a.slot_mapping[:8] // bs, a.block_tables[np.arange(8), 99 // bs])
    np.testing.assert_array_equal(a.slot_mapping[:8] % bs, 99 % bs)
    assert (a.slot_mapping[8:] == 0).all()
    used = a.block_tables[a.block_tables > 0]
    assert len(used) == 8 * math.ceil(100 / bs) == len(np.unique(used))
    np.testing.assert_array_equal(syn.model.logits_indices, np.arange(8))
    assert (runner.cfg.max_num_seqs > syn.sampler.slot_ids).all() and syn.sampler.sample_mask.all()


def test_case_layout_fills_the_bucket():
    assert case_layout(SweepCase(16, 32, 100, "decode"), 2048) is None     # 32 decodes can't fit 16 tokens
    for t, s, c in [(64, 8, 100), (256, 32, 20), (16, 1, 500), (2048, 256, 2048)]:
        starts, counts = case_layout(SweepCase(t, s, c, "mixed"), 2048)
        decodes = len(counts) - 1
        assert counts.sum() == t and len(counts) <= s and decodes <= t // 2
        assert (counts[:decodes] == 1).all() and (starts[:decodes] + 1 == c).all()
        assert starts[-1] + counts[-1] == max(c, counts[-1])       # chunk ends at the context, or is a whole prompt


def test_assign_blocks_distinct_or_evenly_reused():
    rng = np.random.default_rng(0)
    kv_lens = rng.integers(1, 200, 12)
    per_seq = -(-kv_lens // 16)
    for pool in (per_seq.sum() + 5, 20):
        table = assign_blocks(kv_lens, 16, 13, pool + 1, rng)
        used = np.arange(13) < per_seq[:, None]
        assert (table[used] >= 1).all() and (table[used] <= pool).all() and (table[~used] == 0).all()
        counts = np.bincount(table[used], minlength=pool + 1)[1:]
        assert counts.max() - counts.min() <= 1 if per_seq.sum() > pool else counts.max() == 1


def test_step_cost_counts_causal_and_windowed_keys():
    b = Bytes(linear=1, other=4, kv=2)   # FP8 weights, f32 embeddings and head, a 16-bit cache: each counted apart
    kv_token = 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 2
    layers = TINY.num_params - 2 * TINY.vocab_size * TINY.hidden_size
    per_key = 4 * TINY.num_layers * TINY.num_heads * TINY.head_dim
    starts, counts = np.array([9, 4, 4]), np.array([3, 1, 1])        # a 3-token chunk at 9..11, two decodes at 4
    nbytes, flops = step_cost(TINY, b, starts, counts)
    head = TINY.vocab_size * TINY.hidden_size
    assert flops == 2 * 5 * layers + 2 * 3 * head + per_key * (10 + 11 + 12 + 5 + 5)
    assert nbytes == layers + (head + 5 * TINY.hidden_size) * 4 + kv_token * (12 + 5 + 5 + 5)
    _, flops_w = step_cost(dataclasses.replace(TINY, sliding_window=4), b, starts, counts)
    assert flops_w == 2 * 5 * layers + 2 * 3 * head + per_key * (4 * 3 + 4 + 4)


def test_run_sweep_rows(tiny):
    rows = run_sweep(tiny, CFG, token_buckets=(4, 16), seq_buckets=(8,), contexts=(24, 40), warmup=1, repeats=2)
    # a decode case once per seq bucket, its tokens padded to the rows as the engine pads them
    assert [(r["params"]["num_tokens"], r["params"]["context"], r["params"]["kind"]) for r in rows] == [
        (8, 24, "decode"), (4, 24, "mixed"), (8, 40, "decode"), (4, 40, "mixed"), (16, 24, "mixed"), (16, 40, "mixed")]
    for r in rows:
        case = {k: r["params"].pop(k) for k in ("num_tokens", "num_seqs", "context", "kind")}
        assert ROW_FIELDS <= set(r) and r["params"] == {"weight_dtype": "float32", "kv_cache_dtype": "float32"}
        assert r["ms"] > 0 and r["compile_s"] > 0 and 0 < r["roofline_frac"] and math.isfinite(r["roofline_frac"])
        starts, counts = case_layout(SweepCase(**case), CFG.max_model_len)
        assert (r["bytes"], r["flops"]) == step_cost(TINY, Bytes(4, 4, 4), starts, counts)
        assert r["tok_s"] == pytest.approx(counts.sum() / r["ms"] * 1e3)
    assert rows[0]["compile_s"] == rows[2]["compile_s"]   # one compile per bucket, shared by its contexts


@pytest.mark.parametrize("kwargs, field", [(dict(contexts=(0,)), "contexts"), (dict(seq_buckets=(16,)), "seq_buckets"),
                                           (dict(kinds=("prefill",)), "kinds"), (dict(repeats=0), "repeats")])
def test_run_sweep_rejects_bad_arguments(tiny, kwargs, field):
    with pytest.raises(ValueError, match=field):
        run_sweep(tiny, CFG, **kwargs)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 256), min_size=1, max_size=200), st.sets(st.integers(1, 255), max_size=8),
       st.integers(1, 255))
def test_padding_waste_is_the_padded_share_and_more_buckets_never_hurt(counts, ladder, extra):
    counts, ladder = np.array(counts), sorted(ladder | {256})
    padded = [min(b for b in ladder if b >= n) for n in counts]
    assert padding_waste(ladder, counts) == pytest.approx(1 - counts.sum() / sum(padded))
    assert padding_waste(sorted(set(ladder) | {extra}), counts) <= padding_waste(ladder, counts) + 1e-12


def test_pad_to_rejects_a_ladder_that_does_not_cover_the_steps():
    with pytest.raises(ValueError, match="ladder"):
        pad_to([8], np.array([9]))


def test_simulated_steps_respect_the_budget():
    cfg = EngineConfig(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128, min_prefill_chunk=32)
    steps = simulate_steps(cfg, Traffic(prompt_median=100, output_median=40, num_steps=600, warmup_steps=100),
                           np.random.default_rng(0))
    tokens, seqs = steps[:, 0], steps[:, 1]
    assert len(steps) > 500 and (tokens <= 128).all() and (seqs <= 16).all() and (tokens >= seqs).all()
    assert (tokens == seqs).any() and (tokens > seqs).any() and tokens.max() == 128   # decode-only, mixed, full


def test_ladder_rows_price_candidates_consistently():
    sweep = [{"params": {"num_tokens": t}, "ms": 1.0 + t / 16, "compile_s": 2.0, "code_bytes": 100.0}
             for t in (16, 32, 64, 128)]
    steps = np.random.default_rng(0).integers(1, 129, (500, 2))
    steps[:, 1] = np.minimum(steps[:, 0], 8)
    rows = {r["params"]["ladder"]: r for r in ladder_rows(sweep, steps, (16, 32, 64, 128), (4, 8), Traffic())}
    assert set(rows) == set(ladder_candidates((16, 32, 64, 128)))
    chosen = rows["chosen"]
    assert chosen["saved_ms_per_step"] == 0 and chosen["break_even_steps"] is None
    assert chosen["compile_s"] == 2 * 4 * 2.0 and chosen["num_graphs"] == 8 and chosen["code_bytes"] == 800
    for name, r in rows.items():
        more = len(r["params"]["token_buckets"]) - 4
        assert r["extra_compile_s"] == pytest.approx(2 * more * 2.0)
        assert np.sign(r["saved_ms_per_step"]) in (np.sign(more), 0)           # more buckets: less padding time
        assert (r["token_waste_frac"] <= chosen["token_waste_frac"]) == (r["ms"] <= chosen["ms"])
        if r["break_even_steps"] is not None:
            assert r["break_even_steps"] == pytest.approx(r["extra_compile_s"] * 1e3 / r["saved_ms_per_step"])
    assert rows["every 16"]["token_waste_frac"] < chosen["token_waste_frac"] < rows["single"]["token_waste_frac"]


@pytest.mark.slow
def test_cli_bench_sweep_writes_rows_and_plots(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps({"model": "random", "dtype": "f32", "random_model": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512},
        "engine": {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64, "min_prefill_chunk": 16,
                   "num_blocks": 64}}))
    out = tmp_path / "sweep_test.json"
    assert cli_main(["bench", "sweep", "--config", str(config), "--token-buckets", "16", "--seq-buckets", "8",
                     "--contexts", "24", "--kinds", "mixed", "--warmup", "0", "--repeats", "1", "--num-steps", "300",
                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["bench"] for r in rows} == {"sweep", "ladder"}
    for r in rows:
        assert {"bench", "impl", "params", "ms", "tok_s", "device", "jax", "commit", "command"} <= set(r)
    assert ROW_FIELDS <= set(next(r for r in rows if r["bench"] == "sweep"))
    for name in ("tok_s", "roofline_frac", "compile_s", "ladder"):
        assert (tmp_path / f"sweep_test_{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_results_files_accumulate_and_a_same_commit_rerun_replaces_its_rows(tmp_path, monkeypatch):
    """Rows of another commit (a peer's same-run baseline) stay when the same benchmark runs again; a rerun at the
    same commit replaces its own rows; other params add up."""
    out = tmp_path / "rows.json"
    row = lambda ms, **params: {"bench": "b", "impl": "i", "params": params, "ms": ms}   # noqa: E731
    monkeypatch.setenv("JAXSERVE_COMMIT", "aaa")
    write_rows(out, [row(1.0, batch=1), row(2.0, batch=8)], "cmd")
    monkeypatch.setenv("JAXSERVE_COMMIT", "bbb")
    write_rows(out, [row(3.0, batch=1)], "cmd")
    write_rows(out, [row(4.0, batch=1)], "cmd")
    got = sorted((r["commit"], r["params"]["batch"], r["ms"]) for r in json.loads(out.read_text()))
    assert got == [("aaa", 1, 1.0), ("aaa", 8, 2.0), ("bbb", 1, 4.0)]
