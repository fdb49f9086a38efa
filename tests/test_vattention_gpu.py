"""vAttention mode (issue #20) on an NVIDIA GPU: the C++ manager over the real driver (2 MiB pages, DLPack ranges
donated through jitted steps, fences), and the engine on a model whose tokens cross pages, against paged mode.
CPU CI covers the same code with the fake mapper and the manager's dry run (test_vattention*.py); these run
on the device (benchmarks/gpu_session.sh vattention)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.cache.vattention import PAGE_SIZE, CudaPageMapper, VAttentionKVCacheManager, VAttentionGeometry
from jaxserve.models.loader import random_model

from helpers import PAGED, TINY, check_cache_untouched_whole, fuzz, mixed_requests, results, tokens

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (CPU CI: dry run)")

# 4 KiB tokens per range (2 layers x 8 kv heads x 128 x bf16): a 2 MiB page holds 512 tokens of both layers
WIDE = dataclasses.replace(TINY, vocab_size=512, hidden_size=256, intermediate_size=512, num_heads=8,
                           num_kv_heads=8, head_dim=128, max_position_embeddings=4096)
KNOBS = dict(max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=512, min_prefill_chunk=64,
             token_buckets=(64, 512), seq_buckets=(8,), compile_cache_dir=None)
LENGTHS = (1500, 40, 2100, 700, 1030, 9, 300, 1100, 64, 2500)   # 10 > 8 rows; prompts cross 512-token pages
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True)


def prompts(lengths=LENGTHS):
    rng = np.random.default_rng(0)
    return [rng.integers(2, WIDE.vocab_size, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def wide():
    return random_model(WIDE, jnp.bfloat16)


@pytest.fixture(scope="module")
def paged(wide):
    return results(LLM(wide, **KNOBS, num_blocks=2048, **PAGED), prompts(), GREEDY)


def vattention(wide, **knobs) -> LLM:
    return LLM(wide, **{**KNOBS, "num_blocks": 2048, **knobs}, kv_backend="vattention", enable_prefix_caching=False)


def check_logprobs_close(got: list, expected: list) -> None:
    """Greedy outputs agree up to their first difference, where each side's token is in the other's top logprobs
    (a near tie); the rest of such a pair is not compared."""
    for (outs, _), (ref_outs, _) in zip(got, expected, strict=True):
        for (ids, lps), (ref_ids, ref_lps) in zip(outs, ref_outs, strict=True):
            assert len(ids) == len(ref_ids)
            for i, (a, b) in enumerate(zip(ids, ref_ids)):
                if a != b:
                    assert a in ref_lps[i] and b in lps[i], f"token {i}: {a} vs {b}, not a near tie"
                    break


def test_exported_range_is_zero_copy_and_a_donated_step_updates_it_in_place():
    """Only rows 1 and 2's leading pages are mapped: a jitted donated scatter into them keeps the range's address
    (no copy of the mostly unmapped range, which would fault), and reads back what it wrote."""
    g = VAttentionGeometry(num_seqs=3, max_model_len=4096, block_size=16, token_bytes=2048, num_pages=8)
    mapper = CudaPageMapper(g, num_tensors=2)
    (m,) = mapper.managers
    mapper.map(1, 2)
    mapper.map_ahead(2, 1)
    assert mapper.num_mapped(2) == 1 and m.num_free_pages == g.num_pages - 3
    shape = (g.rows * g.blocks_per_row, g.block_size, 8, 128)
    cache = mapper.export(0, shape, jnp.bfloat16)[0]
    assert cache.unsafe_buffer_pointer() == m.base(0)
    rows = np.array([g.blocks_per_row + 5, g.blocks_per_row + 70, 2 * g.blocks_per_row + 3], np.int32)
    values = jax.random.normal(jax.random.key(0), (3, g.block_size, 8, 128), jnp.bfloat16)
    write = jax.jit(lambda c, i, v: c.at[i].set(v), donate_argnums=0)
    cache = write(cache, rows, values)
    assert cache.unsafe_buffer_pointer() == m.base(0)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda c, i: c[i])(cache, rows)), np.asarray(values))
    del cache
    mapper.close()


def test_the_real_driver_runs_the_accounting_fuzz():
    """Admit / grow / free / preempt / fork against the counting model, every map and unmap a real one."""
    g = VAttentionGeometry(num_seqs=6, max_model_len=4096, block_size=16, token_bytes=2048, num_pages=14)
    mapper = CudaPageMapper(g, num_tensors=2)
    kv = VAttentionKVCacheManager(g, mapper, lookahead_tokens=700, watermark=0.05)
    fuzz(kv, mapper, seed=3, steps=200)
    (m,) = mapper.managers
    m.sync()
    assert m.num_free_pages == g.num_pages - kv.total_mapped
    mapper.close()


@pytest.mark.parametrize("kernels, lookahead", [("identity", 0), ("contiguous", 0), ("contiguous", 512)])
def test_engine_matches_paged_across_pages_and_slot_reuse(wide, paged, kernels, lookahead):
    """Identity tables run paged mode's kernels on the same steps: the same bits. Contiguous kernels (stage 2)
    address rows by row: the same greedy tokens."""
    llm = vattention(wide, vattention_kernels=kernels, vattention_lookahead_tokens=lookahead)
    assert llm.engine.kv.geometry.page_size == PAGE_SIZE
    got = results(llm, prompts(), GREEDY)
    assert got == paged if kernels == "identity" else tokens(got) == tokens(paged)
    kv = llm.engine.kv
    assert max(kv.mapped) >= 3 and kv.num_free_pages == kv.geometry.num_pages - kv.null_pages
    assert llm.engine.stats()["compiles_after_start"] == 0


@pytest.mark.parametrize("kernels", ["identity", "contiguous"])
def test_preemption_forks_and_every_request_kind_in_a_small_pool(wide, paged, kernels):
    """12 usable pages (6144 tokens): preemption and row reuse remap pages (deferred unmaps behind fences), n = 3
    forks copy a prompt across pages; sampled, penalties, logprobs, prompt logprobs compile nothing new. A
    preempted request recomputes its tokens in other batches and kernels (prefill, not decode): in bf16 its greedy
    tokens may leave paged mode's only at a near tie (vLLM's check_logprobs_close)."""
    llm = vattention(wide, vattention_kernels=kernels, num_blocks=385)   # 6144 tokens + the null block's page
    check_logprobs_close(results(llm, prompts(), GREEDY), paged)
    fork = results(llm, prompts((1200,)), SamplingParams(temperature=1.0, n=3, seed=3, max_tokens=16))
    assert len(set(map(tuple, tokens(fork)[0]))) == 3
    mixed, params = mixed_requests()
    assert len(results(llm, mixed, params)) == len(mixed)
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0 and stats["compiles_after_start"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_no_compiled_gpu_step_reads_the_whole_cache(wide):
    """The compiled GPU graphs (the model per bucket, block copies): cache aliased in and out, touched only by the
    scatter, the kernels and custom calls — anything else would read unmapped pages and kill the process."""
    graphs = vattention(wide).engine.graphs
    cache_bound = [v for k, v in graphs.manager.executables.items() if k.num_blocks is not None]
    assert len(cache_bound) >= 3
    for compiled in cache_bound:
        check_cache_untouched_whole(compiled, graphs.cache_shape.k)


# 32 layers: 64 KiB tokens per range, a 2 MiB page holds 32 tokens (Llama-3-8B's cross-layer geometry)
DEEP = dataclasses.replace(WIDE, num_layers=32)


@pytest.mark.parametrize("kernels", ["contiguous", "identity"])
def test_small_batches_never_read_unmapped_pages_of_32_token_pages(kernels):
    """Short contexts at small batches: decode-only launches split each context over many programs, whose first
    tiles lie past the few pages a row has mapped (a kernel that loaded them before knowing the length faulted
    here: CUDA_ERROR_ILLEGAL_ADDRESS). Lazy mapping (look-ahead), so that no row has spare pages mapped."""
    deep = random_model(DEEP, jnp.bfloat16)
    knobs = {**KNOBS, "num_blocks": 512, "max_num_seqs": 4, "seq_buckets": (4,)}
    lengths, params = (5, 40, 70, 130), SamplingParams(temperature=0.0, max_tokens=40, logprobs=3, ignore_eos=True)
    expected = results(LLM(deep, **knobs, **PAGED), prompts(lengths), params)
    llm = LLM(deep, **knobs, kv_backend="vattention", enable_prefix_caching=False, vattention_kernels=kernels,
              vattention_lookahead_tokens=32)
    assert llm.engine.kv.geometry.pages_for(32) == 1
    check_logprobs_close(results(llm, prompts(lengths), params), expected)
