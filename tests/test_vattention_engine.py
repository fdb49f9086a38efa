"""vAttention mode in the engine, on CPU, with both kernel addressings: "contiguous" (a step carries each row's
slot, the kernels compute its block ids; no block table anywhere) and "identity" (the paged kernels over identity
block tables). Where the schedule is the same as paged mode's, greedy tokens and
logprobs must be bit-identical to it, so to each other (and tokens wherever the pool differs: preemption, forks
waiting for their pages). Every step must touch only pages the (fake) mapper made ready, and no compiled graph may
read the whole cache array.

The CPU stand-in's page size is lowered here (tests only: vattention.CPU_PAGE_SIZE): a 2 MiB page holds 8K of the
tiny model's 256-byte tokens (both layers: the cache is cross-layer), so no prompt would ever cross a page."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.cache import vattention as vattention_module
from jaxserve.engine import step_graphs
from jaxserve.engine.llm_engine import NeverFits
from jaxserve.engine.step_inputs import Layout
from jaxserve.models.attention import AttentionKernels
from jaxserve.models.loader import random_model

from helpers import (KNOBS, PAGED, TINY, check_cache_untouched_whole, mixed_requests, results,
                     token_prompts, tokens)

PAGE_SIZE = 2000   # 7.8 of TINY's 256-byte tokens (2 layers x 2 kv heads x 16 x f32): tokens and blocks straddle pages
VATTENTION = dict(kv_backend="vattention", enable_prefix_caching=False)   # vattention_kernels: contiguous
KERNELS = ("contiguous", "identity")
BASE = {**KNOBS, "precompile": False, "num_blocks": 256}
PROMPTS = token_prompts(5, 17, 33, 9, 40, 3, 12, 200, 70, 31, 8, 100)   # 12 > max_num_seqs: slots reused
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return random_model(TINY, jnp.float32)


@pytest.fixture(autouse=True)
def small_pages(monkeypatch):
    monkeypatch.setattr(vattention_module, "CPU_PAGE_SIZE", PAGE_SIZE)


def vattention(kernels: str = "contiguous") -> dict:
    return dict(VATTENTION, vattention_kernels=kernels)


def row_blocks(attn, g) -> list[np.ndarray]:
    """The blocks each live row reads, up to its last token: its block-table row, or its slot's (contiguous)."""
    n = attn.num_seqs[0]
    num_blocks = -(-attn.kv_lens[:n] // g.block_size)
    if attn.kv_rows is None:
        return [table[:b] for table, b in zip(attn.block_tables, num_blocks)]
    return [slot * g.blocks_per_row + np.arange(b) for slot, b in zip(attn.kv_rows, num_blocks)]


def watch_pages(llm: LLM) -> list:
    """Before each step launches: every cache write, every block a row reads (up to its last token) and every
    block copy must lie on pages the fake mapper has made ready (on a GPU any other page is unmapped), each row's
    blocks in one row of the range; contiguous kernels' steps carry slots and no block table. Returns the steps
    checked."""
    runner, g = llm.engine.runner, llm.engine.kv.geometry
    mapper, checked, contiguous = llm.engine.kv.mapper, [], llm.engine.cfg.vattention_kernels == "contiguous"

    def ready(block_ids, offsets) -> bool:
        rows, blocks_in_row = np.divmod(np.asarray(block_ids), g.blocks_per_row)
        return all(g.pages_for(b * g.block_size + o + 1) <= mapper.ready[r]
                   for r, b, o in zip(rows, blocks_in_row, np.asarray(offsets)))

    def check(step):
        if step.inputs is not None:
            attn = step.inputs.model.attn
            assert (attn.block_tables is None, attn.kv_rows is None) == (contiguous, not contiguous)
            writes = attn.slot_mapping
            assert ready(writes // g.block_size, writes % g.block_size), "a step writes an unmapped page"
            for blocks in row_blocks(attn, g):
                assert len(set(blocks // g.blocks_per_row)) == 1 and ready(blocks, [g.block_size - 1] * len(blocks))
        if step.copies is not None:
            assert ready(np.concatenate(step.copies), [g.block_size - 1] * 2 * len(step.copies[0]))
        checked.append(step)
    runner.observe_launches(check)
    return checked


MIXED_GREEDY = [GREEDY] * 11 + [SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2)]


@pytest.fixture(scope="module")
def paged_greedy(tiny):
    return results(LLM(tiny, **BASE, **PAGED), PROMPTS, MIXED_GREEDY)


@pytest.mark.parametrize("kernels, lookahead", [("contiguous", 0), ("contiguous", 24), ("identity", 0)])
def test_greedy_tokens_and_logprobs_are_bit_identical_to_paged(tiny, paged_greedy, kernels, lookahead):
    """Chunked prefill across pages (a 200-token prompt in 64-token chunks, 26 pages), more requests than slots,
    prompt logprobs: the same steps as paged mode, so the same bits, whichever kernels address the rows."""
    llm = LLM(tiny, **BASE, **vattention(kernels), vattention_lookahead_tokens=lookahead)
    steps = watch_pages(llm)
    assert results(llm, PROMPTS, MIXED_GREEDY) == paged_greedy
    kv, stats = llm.engine.kv, llm.engine.stats()
    assert len(steps) > 20 and max(kv.mapped) >= kv.geometry.pages_for(200) > 20
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["compiles_after_start"] > 0
    assert any(op == "map_ahead" for op, _, _ in llm.engine.kv.mapper.log) == (lookahead > 0)


@pytest.mark.parametrize("kernels", KERNELS)
def test_preemption_under_a_small_page_pool_keeps_the_tokens(tiny, kernels):
    expected = results(LLM(tiny, **BASE, **PAGED), PROMPTS, GREEDY)
    llm = LLM(tiny, **{**BASE, "num_blocks": 30}, **vattention(kernels))   # 63 pages: 492 tokens, 12 x up to 220
    watch_pages(llm)
    assert tokens(results(llm, PROMPTS, GREEDY)) == tokens(expected)
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("num_blocks", [256, 30], ids=["roomy", "forks-wait"])
def test_forks_copy_the_prompt_and_wait_for_their_pages(tiny, num_blocks, kernels, monkeypatch):
    """n = 3 (seeded sampling): each child decodes from its copy of the parent's KV (block copies: identity block
    ids, whichever kernels read them). In a small pool the prompt's last chunk waits until the copies fit (never
    a ForkError); in a roomy one the steps, so the bits, are paged's."""
    prompts = PROMPTS[7:9] + [PROMPTS[11], PROMPTS[4]]   # 200, 70, 100 tokens, then the n = 3 request's 40
    params = [GREEDY] * 3 + [SamplingParams(temperature=1.0, n=3, seed=3, max_tokens=20, logprobs=2)]
    expected = results(LLM(tiny, **BASE, **PAGED), prompts, params)
    llm = LLM(tiny, **{**BASE, "num_blocks": num_blocks}, **vattention(kernels))
    steps = watch_pages(llm)
    kv, answers = llm.engine.kv, []
    can_fork = kv.can_fork
    monkeypatch.setattr(kv, "can_fork", lambda *a: answers.append(can_fork(*a)) or answers[-1])
    got = results(llm, prompts, params)
    assert got == expected if num_blocks == 256 else tokens(got) == tokens(expected)
    assert len(set(map(tuple, tokens(got)[3]))) == 3 and (False in answers) == (num_blocks == 30)
    assert sum(len(s.copies[0]) for s in steps if s.copies is not None) >= 2 * -(-40 // 16)   # 2 children's blocks


@pytest.mark.parametrize("decode", ["pallas", "cuda"])
def test_decode_kernels_address_rows_by_slot(decode, monkeypatch):
    """Where a decode kernel runs (the GPU), decode-only steps have graphs of their own: under contiguous kernels
    the contiguous Pallas decode, or the CUDA call over identity tables the graph builds from the slots (on the CPU
    both run pure JAX: the CUDA call's reference sums in another order, so tokens only). head_dim 64: the call's."""
    monkeypatch.setattr(step_graphs, "resolve_attention_kernels",
                        lambda _d, _p, _h, blocks_per_row=None, _dtype=None: AttentionKernels(decode, "triton",
                                                                                            blocks_per_row))
    model = random_model(dataclasses.replace(TINY, head_dim=64), jnp.float32)
    expected = results(LLM(model, **BASE, **PAGED), PROMPTS[:6], GREEDY)
    llm = LLM(model, **BASE, **VATTENTION)
    steps = watch_pages(llm)
    got = results(llm, PROMPTS[:6], GREEDY)
    assert got == expected if decode == "pallas" else tokens(got) == tokens(expected)
    assert sum(s.inputs.model.attn.decode_only for s in steps if s.inputs is not None) > 10


def test_requests_that_never_fit_are_refused_and_the_engine_keeps_serving(tiny):
    """Pool of 19 usable pages = 148 tokens of one sequence (paged: 9 blocks = 144): a longer request, a prompt
    longer than a slot, or n copies of a prompt that cannot fit together are refused at once."""
    llm = LLM(tiny, **{**BASE, "num_blocks": 10}, **VATTENTION)
    engine = llm.engine
    assert engine.kv.max_tokens_per_seq == 144
    with pytest.raises(NeverFits, match="holds 144 per sequence"):
        engine.add_request([3] * 100, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="max_model_len=256"):
        engine.add_request([3] * 300, SamplingParams(max_tokens=1))
    with pytest.raises(NeverFits, match="n=3 copies"):
        engine.add_request([3] * 60, SamplingParams(max_tokens=4, n=3))
    params = SamplingParams(temperature=1.0, n=2, seed=5, max_tokens=20)
    expected = results(LLM(tiny, **BASE, **PAGED), [PROMPTS[1]], params)
    assert tokens(results(llm, [PROMPTS[1]], params)) == tokens(expected)
    assert not engine.scheduler.has_work() and not engine.requests


@pytest.fixture(scope="module")
def precompiled(tiny):
    """Engines compiled before serving: vattention with each kernels, and their paged reference."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vattention_module, "CPU_PAGE_SIZE", PAGE_SIZE)
        engines = {kernels: LLM(tiny, **{**KNOBS, "num_blocks": 128}, **vattention(kernels)) for kernels in KERNELS}
        return {**engines, "paged": LLM(tiny, **{**KNOBS, "num_blocks": 128}, **PAGED)}


@pytest.mark.parametrize("kernels", KERNELS)
def test_no_graph_compiles_after_start_and_every_request_kind_matches_paged(precompiled, kernels):
    llm = precompiled[kernels]
    watch_pages(llm)
    prompts, params = mixed_requests()
    assert results(llm, prompts, params) == results(precompiled["paged"], prompts, params)
    assert llm.engine.stats()["compiles_after_start"] == 0


def test_a_long_prompts_fork_copies_compile_nothing(precompiled):
    """n = 3 over a 200-token prompt copies 26 blocks, more than the largest precompiled copy graph (paged
    copy-on-write never copies more than max_num_seqs at once): the copies run in chunks of it."""
    llm = precompiled["contiguous"]
    out = llm.generate([PROMPTS[7]], SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and llm.engine.stats()["compiles_after_start"] == 0


@pytest.mark.parametrize("kernels", KERNELS)
def test_contiguous_steps_carry_one_slot_per_row_and_no_block_table(precompiled, kernels):
    """Contiguous kernels: the host keeps one slot per device slot, a step's inputs carry [S] slots, and no model
    graph unpacks an int32 [S, W] table from the bytes it is sent; identity mode's do (so the check would see one)."""
    engine, contiguous = precompiled[kernels].engine, kernels == "contiguous"
    graphs = engine.graphs
    attn = graphs.step_inputs(num_tokens=16, num_seqs=4).model.attn
    assert engine.runner.block_table.table.ndim == (1 if contiguous else 2)
    assert attn.block_tables is None if contiguous else attn.block_tables.shape == (4, graphs.max_blocks_per_seq)
    assert attn.kv_rows.shape == (4,) if contiguous else attn.kv_rows is None
    models = [k for k in graphs.manager.executables if k.kind == "model"]
    assert len(models) >= 4
    for key in models:
        leaves = Layout.of(graphs.key_inputs(key).model).leaves
        assert any(len(shape) == 2 and dtype == "int32" for shape, dtype in leaves) != contiguous


@pytest.mark.parametrize("kernels", KERNELS)
def test_no_compiled_step_reads_the_whole_cache(precompiled, kernels):
    """Every graph that takes the cache (the model per bucket, block copies): aliased in and out, and touched only
    by the scatter, the kernels' indexed reads and custom calls. On a GPU anything else reads unmapped pages."""
    graphs = precompiled[kernels].engine.graphs
    struct = graphs.cache_shape.k
    cache_bound = {k: v for k, v in graphs.manager.executables.items() if k.num_blocks is not None}
    assert len(cache_bound) >= 4 and {k.kind for k in cache_bound} == {"model", "copy"}
    for compiled in cache_bound.values():
        check_cache_untouched_whole(compiled, struct)


def test_the_cache_guard_catches_a_dropped_donation_and_a_whole_cache_read(precompiled):
    graphs = precompiled["contiguous"].engine.graphs
    struct = graphs.cache_shape.k
    inp = graphs.step_inputs(num_tokens=16, num_seqs=4)
    undonated = jax.jit(graphs.model.__wrapped__, static_argnums=6).lower(
        graphs.params, graphs.cache_shape, graphs.last_tokens, *step_graphs.model_args(inp, None, None))
    with pytest.raises(AssertionError, match="not aliased"):
        check_cache_untouched_whole(undonated.compile(), struct)
    summed = jax.jit(lambda c: (c + 1, c.sum()), donate_argnums=0).lower(struct).compile()
    with pytest.raises(AssertionError, match="add|reduce"):
        check_cache_untouched_whole(summed, struct)


@pytest.mark.parametrize("knobs, field", [
    (dict(kv_backend="contiguous"), "kv_backend"),
    (dict(kv_backend="vattention"), "enable_prefix_caching"),   # its default is true: say to set it false
    (dict(kv_backend="vattention", enable_prefix_caching=False, vattention_lookahead_tokens=-1),
     "vattention_lookahead_tokens"),
    (dict(kv_backend="vattention", enable_prefix_caching=False, tensor_parallel_size=2), "tensor_parallel_size"),
    (dict(kv_backend="vattention", enable_prefix_caching=False, vattention_kernels="paged"), "vattention_kernels"),
])
def test_bad_vattention_knobs_name_the_field(knobs, field):
    with pytest.raises(ValueError, match=f"engine config: {field} "):
        EngineConfig(**knobs)


def test_cpu_refuses_a_virtual_range_it_cannot_allocate(tiny, monkeypatch):
    monkeypatch.setattr(vattention_module, "CPU_PAGE_SIZE", 4 << 20)   # 16K tokens a row: 9 rows x 2 ranges = 72 MiB
    monkeypatch.setattr(vattention_module, "CPU_MAX_KV_BYTES", 64 << 20)
    with pytest.raises(ValueError, match="whole virtual range, 0.1 GiB .* lower max_num_seqs or max_model_len"):
        LLM(tiny, **BASE, **VATTENTION)


@pytest.mark.slow
def test_smollm2_greedy_matches_paged(smollm, monkeypatch):
    """The embedded model: 23,040-byte tokens (30 layers x 768), 120 KiB pages (5.3 tokens a page, blocks straddle
    pages)."""
    monkeypatch.setattr(vattention_module, "CPU_PAGE_SIZE", 30 * 4096)
    knobs = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, min_prefill_chunk=16,
                 token_buckets=(32,), seq_buckets=(4,), num_blocks=64, precompile=False, compile_cache_dir=None)
    ids = [smollm.tokenizer(p)["input_ids"] for p in ("The capital of France is", "def fib(n):" * 6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    llm = LLM(smollm, **knobs, **VATTENTION)
    watch_pages(llm)
    assert results(llm, ids, params) == results(LLM(smollm, **knobs, **PAGED), ids, params)
