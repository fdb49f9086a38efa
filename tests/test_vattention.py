"""vAttention mode (issue #20) on CPU: the page accounting fuzzed against a plain model (with the fake mapper,
and with the C++ manager's dry run under it), best fit, reclamation, refusals, forks, the identity block table;
the C++ manager built with nvcc (the build's own flags), its C ABI exported, its dry-run bookkeeping and its
clear failure without a driver."""
import subprocess

import numpy as np
import pytest

from custom_calls import build
from jaxserve.cache.vattention import (CudaPageMapper, FakePageMapper, ForkError, VAttentionKVCacheManager,
                                       VAttentionGeometry)

from helpers import fuzz

C_ABI = ("vmm_last_error", "vmm_granularity", "vmm_create", "vmm_destroy", "vmm_page_size", "vmm_base", "vmm_map",
         "vmm_map_async", "vmm_sync", "vmm_trim", "vmm_record_fence", "vmm_poll", "vmm_num_mapped",
         "vmm_num_free_pages", "vmm_num_deferred", "vmm_dry_complete_fences", "vmm_export_dlpack",
         "JaxserveVmmFence")
# page 4 KiB, 384-byte tokens: 10.67 tokens a page, so tokens straddle pages
GEOMETRIES = [dict(num_seqs=6, max_model_len=100, block_size=4, token_bytes=384, num_pages=28, page_size=4096),
              dict(num_seqs=4, max_model_len=64, block_size=16, token_bytes=512, num_pages=12, page_size=4096)]


def make(geometry: dict, mapper: str = "fake", library=None, **kw):
    g = VAttentionGeometry(**geometry)
    if mapper == "fake":
        m = FakePageMapper(g.num_pages, g.rows, g.pages_per_row)
    else:
        m = CudaPageMapper(g, num_tensors=2, dry_run=True, library=library)
    return VAttentionKVCacheManager(g, m, **kw), m


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("lookahead", [0, 12])
@pytest.mark.parametrize("seed", range(4))
def test_fuzz_page_accounting_against_model(geometry, lookahead, seed):
    kv, mapper = make(geometry, lookahead_tokens=lookahead, watermark=0.05, premap=seed % 2 == 1)
    seen = fuzz(kv, mapper, seed)
    assert all(seen.values()), f"seed {seed}: the fuzz missed a case: {seen}"


def test_best_fit_prefers_smallest_slot_with_enough_mapped_pages():
    kv, mapper = make(dict(num_seqs=4, max_model_len=64, block_size=4, token_bytes=1024, num_pages=40,
                           page_size=4096), watermark=0)   # 4 tokens a page
    for seq_id, n in enumerate([40, 12, 24, 4]):   # rows 1..4 with 10, 3, 6, 1 pages
        assert kv.allocate(seq_id, [1] * n, n) == (True, 0)
    assert [kv.row_of(i) for i in range(4)] == [1, 2, 3, 4]
    for seq_id in range(4):
        kv.free(seq_id)
    assert kv.mapped[1:] == [10, 3, 6, 1] and kv.num_free_pages == 39   # freed rows keep their pages
    kv.allocate(10, [1] * 17, 17)   # 5 pages: row 3 (6) is the tightest fit
    kv.allocate(11, [1] * 9, 9)     # 3 pages: row 2 exactly
    kv.allocate(12, [1] * 60, 60)   # 15 pages: nothing fits, the most mapped (row 1, 10 pages) grows
    assert [kv.row_of(i) for i in (10, 11, 12)] == [3, 2, 1]
    assert not any(op == "trim" for op, *_ in mapper.log) and kv.mapped[1:] == [15, 3, 6, 1]


def test_premap_spreads_the_pool_so_admissions_map_nothing():
    """Eager allocation: every pool page mapped at start, evenly over the rows; a sequence within its row's
    share maps nothing, a longer one reclaims from free rows."""
    kv, mapper = make(dict(num_seqs=4, max_model_len=64, block_size=4, token_bytes=1024, num_pages=15,
                           page_size=4096), watermark=0, premap=True)   # 4 tokens a page, 16 pages a row
    assert kv.mapped == [1, 3, 3, 4, 4] and kv.total_mapped == 15 and kv.ready == kv.mapped
    maps = len(mapper.log)
    assert kv.allocate("a", [1] * 12, 12) == (True, 0) and len(mapper.log) == maps   # 3 pages: row 1's own
    assert kv.allocate("b", [1] * 40, 40) == (True, 0)   # 10 pages: the most mapped free row grows by reclaiming
    assert any(op == "trim" for op, *_ in mapper.log[maps:]) and kv.mapped[kv.row_of("b")] == 10
    assert kv.total_mapped <= 15


def test_a_prompts_later_chunks_are_mapped_ahead_on_the_mapper_thread():
    """Chunked prefill under eager allocation: the first chunk's pages are the step's (ready), the rest of the
    prompt's are taken at once from free rows' spare pages and mapped on the mapper thread while steps run, so the
    next chunk reclaims nothing and its synchronous map finds its pages mapped."""
    kv, mapper = make(dict(num_seqs=4, max_model_len=64, block_size=4, token_bytes=1024, num_pages=15,
                           page_size=4096), watermark=0, premap=True)   # 4 tokens a page; rows hold 3, 3, 4, 4
    prompt, log = [1] * 48, len(mapper.log)   # 12 pages
    assert kv.allocate("a", prompt, 16) == (True, 0)
    row = kv.row_of("a")
    assert (kv.ready[row], kv.pinned[row], kv.mapped[row]) == (4, 4, 12) and kv.num_free_pages == 10
    assert ("map_ahead", row, 12) in mapper.log[log:] and any(op == "trim" for op, *_ in mapper.log[log:])
    log = len(mapper.log)
    assert kv.allocate("a", prompt, 16) == (True, 0) and kv.ready[row] == 8
    assert mapper.log[log:] == [("map", row, 8)] and mapper.num_mapped(row) == 12


def test_reclaim_takes_free_rows_pages_before_a_live_rows_mapped_ahead_ones():
    kv, mapper = make(dict(num_seqs=4, max_model_len=64, block_size=4, token_bytes=1024, num_pages=23,
                           page_size=4096), watermark=0, premap=True)   # rows hold 5, 5, 6, 6
    assert kv.allocate("a", [1] * 48, 16) == (True, 0)   # 4 pages its step's, 8 mapped ahead
    a = kv.row_of("a")
    assert (kv.pinned[a], kv.mapped[a]) == (4, 12)
    assert kv.allocate("b", [1] * 40, 40) == (True, 0)   # 10 pages: the free rows' 10, not a's spare 8
    assert kv.mapped[a] == 12 and not any(op == "trim" and row == a for op, row, _ in mapper.log)


def test_reclaims_free_rows_only_when_the_pool_runs_short_and_refuses_past_budget():
    kv, mapper = make(dict(num_seqs=3, max_model_len=64, block_size=4, token_bytes=1024, num_pages=17,
                           page_size=4096), watermark=0)   # 16 usable pages
    assert kv.allocate("a", [1] * 40, 40) == (True, 0) and kv.allocate("b", [1] * 24, 24) == (True, 0)
    kv.free("a")
    assert kv.mapped[1] == 10 and kv.num_free_pages == 10
    assert kv.allocate("c", [1] * 64, 64) == (False, 0)   # 16 pages > 10 free: refused, nothing changed
    assert kv.mapped[1:] == [10, 6, 0] and "c" not in kv.seqs
    assert kv.allocate("c", [1] * 16, 16) == (True, 0)     # best fit reuses row 1 (10 pages, keeps them)
    assert kv.row_of("c") == 1 and kv.mapped[1] == 10
    assert kv.allocate("d", [1] * 16, 16) == (True, 0)     # 4 pages: 0 unmapped, so row 1's spare 6 give 4
    assert ("trim", 1, 6) in mapper.log and kv.mapped[1:] == [6, 6, 4]
    assert kv.allocate("c", [1] * 30, 14) == (False, 0)    # needs 4 more pages, 2 left
    assert kv.allocate("c", [1] * 24, 8) == (True, 0)


def test_growth_and_capacity_in_block_units_match_the_paged_manager_contract():
    kv, _ = make(dict(num_seqs=2, max_model_len=64, block_size=4, token_bytes=1024, num_pages=9, page_size=4096),
                 watermark=0)
    assert kv.num_blocks == 1 + 8 and kv.num_free_blocks == 8 and kv.usage == 0.0 and kv.max_tokens_per_seq == 32
    assert kv.lookup_prefix([1, 2, 3]) == 0
    assert kv.geometry.blocks_per_row == 17   # 64 tokens = 16 pages, rounded up to an odd number of pages
    assert kv.allocate(1, [5] * 6, 6) == (True, 0) and kv.take_block_updates() == [(1, 0, [17, 18])]
    assert kv.allocate(1, [5] * 7, 1) == (True, 0) and kv.take_block_updates() == []   # same block
    assert kv.allocate(1, [5] * 9, 2) == (True, 0) and kv.take_block_updates() == [(1, 2, [19])]
    assert kv.num_free_blocks == 5 and kv.usage == pytest.approx(3 / 8)
    with pytest.raises(ValueError, match="exceed len"):
        kv.allocate(1, [5] * 9, 1)
    with pytest.raises(ValueError, match="max_model_len"):
        kv.allocate(1, [5] * 70, 61)
    with pytest.raises(ValueError, match="prefix caching is off"):
        make(GEOMETRIES[0], enable_prefix_caching=True)
    assert [len(x) for x in kv.take_copies()] == [0, 0]


def test_fork_copies_the_parent_after_its_step_and_holds_its_pages_until_then():
    kv, _ = make(dict(num_seqs=3, max_model_len=64, block_size=4, token_bytes=1024, num_pages=12, page_size=4096),
                 watermark=0)
    bps = kv.geometry.blocks_per_row
    kv.allocate("p", [1] * 10, 10)
    kv.fork("p", "c")
    p, c = kv.row_of("p"), kv.row_of("c")
    assert p != c and kv.mapped[c] >= 3 and kv.block_ids("c") == [c * bps + i for i in range(3)]
    assert [len(x) for x in kv.take_copies()] == [0, 0]   # the parent's last chunk is written by this step
    kv.free("p")   # finished before its copy ran: the row is free, its pages stay pinned
    assert p in kv.free_rows and kv.pinned[p] == 3
    kv.allocate("q", [1] * 2, 2)   # best fit re-places the row: its writes come after the copy
    assert kv.row_of("q") == p and kv.pinned[p] == 3
    src, dst = kv.take_copies()
    assert src.tolist() == [p * bps + i for i in range(3)] and dst.tolist() == [c * bps + i for i in range(3)]
    assert kv.pinned[p] == 1 and kv.mapped[p] == 3
    kv.free("q")
    assert kv.pinned[p] == 0
    kv.fork("c", "c2")
    kv.free("c2")   # a child gone before its copy: no copy
    kv.take_copies()
    assert [len(x) for x in kv.take_copies()] == [0, 0]
    kv.allocate("big", [1] * 28, 28)   # 7 pages: the pool has 11 usable, 3 pinned by c
    assert kv.can_fork("c", 1) is False
    with pytest.raises(ForkError, match="pages"):
        kv.fork("c", "c3")


def test_geometry_pads_rows_to_whole_pages_and_blocks():
    g = VAttentionGeometry(num_seqs=8, max_model_len=2048, block_size=16, token_bytes=30 * 3 * 64 * 2, num_pages=10)
    assert g.tokens_per_row == 8192 and g.row_bytes % g.page_size == 0 and g.blocks_per_row == 512
    g = VAttentionGeometry(num_seqs=8, max_model_len=4000, block_size=16, token_bytes=32 * 8 * 128 * 2, num_pages=10)
    assert g.tokens_per_row == 4000 and g.pages_for(32) == 1 and g.pages_for(33) == 2   # Llama-3-8B megacache


# ---------------------------------------------------------------- the C++ manager: nvcc build, C ABI, dry run

@pytest.fixture(scope="session")
def vmm_library(tmp_path_factory):
    """vmm_manager.cu alone, compiled with the build's nvcc flags (sm_90a only: fast)."""
    import jax
    try:
        nvcc = build.find_nvcc()
    except build.BuildError as err:
        pytest.skip(f"nvcc is not installed on this machine: {err}")
    out = tmp_path_factory.mktemp("vmm") / "libvmm.so"
    source = build.SOURCE_DIR / "vmm_manager.cu"
    cmd = [nvcc, *build.FLAGS, *build.gencode_flags(("sm_90a",)), f"-I{jax.ffi.include_dir()}",
           f"-I{build.SOURCE_DIR}", str(source), "-o", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return str(out)


@pytest.mark.slow
def test_library_builds_with_the_library_and_exports_the_c_abi(vmm_library):
    assert build.SOURCE_DIR / "vmm_manager.cu" in build.sources()   # part of libjaxserve_cuda.so
    exported = subprocess.run(["nm", "-D", "--defined-only", vmm_library], capture_output=True, text=True,
                              check=True).stdout
    for symbol in C_ABI:
        assert f" T {symbol}\n" in exported, f"{symbol} not exported"
    needed = subprocess.run(["readelf", "-d", vmm_library], capture_output=True, text=True, check=True).stdout
    assert "libcuda" not in needed, "the driver must be resolved at run time, not linked"


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("lookahead", [0, 12])
@pytest.mark.slow
def test_fuzz_through_the_cpp_manager_dry_run(vmm_library, geometry, lookahead):
    kv, mapper = make(geometry, "cuda", vmm_library, lookahead_tokens=lookahead, watermark=0.05)
    fuzz(kv, mapper, seed=lookahead, steps=250)   # the dry backend raises on any map over a mapped page
    (m,) = mapper.managers
    m.sync()
    assert m.num_free_pages == kv.geometry.num_pages - kv.total_mapped
    mapper.close()


@pytest.mark.slow
def test_cpp_manager_defers_unmaps_until_the_fence_and_refuses_past_the_pool(vmm_library):
    from custom_calls.vmm import VmmError, VmmManager
    m = VmmManager(device=0, num_rows=3, num_tensors=2, row_bytes=4 * 4096, num_pages=5, page_size=4096,
                   dry_run=True, path=vmm_library)
    m.map(1, 3)
    m.map_async(2, 2)
    m.sync()
    assert (m.num_mapped(1), m.num_mapped(2), m.num_free_pages) == (3, 2, 0)
    with pytest.raises(VmmError, match="page pool exhausted"):
        m.map(0, 1)
    m.record_fence()   # a step that may read row 1 was launched
    m.trim(1, 1)
    assert (m.num_mapped(1), m.num_free_pages, m.num_deferred) == (1, 2, 2)   # pages back, unmaps wait
    m.map(0, 2)   # other rows take the pages at once (stream order protects their data)
    assert m.complete_fences(0) == 2 * (1 + 2 + 2 + 2)   # row 1's old pages still mapped in both ranges
    m.complete_fences(1)
    m.poll()
    assert m.num_deferred == 0 and m.complete_fences(1) == 2 * (1 + 2 + 2)
    m.record_fence()
    m.trim(0, 0)
    m.map(0, 1)   # remapping a page whose unmap waits on a fence: waits for it, unmaps, maps again
    assert m.num_deferred == 0 and m.num_mapped(0) == 1 and m.complete_fences(0) == 2 * (1 + 1 + 2)
    with pytest.raises(VmmError, match="exceed a row"):
        m.map(1, 5)
    m.close()
    with pytest.raises(VmmError, match="closed"):
        m.map(1, 1)


@pytest.mark.slow
def test_cpp_manager_without_a_driver_fails_clearly(vmm_library):
    from custom_calls.vmm import VmmError, VmmManager
    import jax
    if jax.default_backend() == "gpu":
        pytest.skip("a driver is present")
    with pytest.raises(VmmError, match="needs an NVIDIA GPU"):
        VmmManager(device=0, num_rows=2, num_tensors=2, row_bytes=1 << 21, num_pages=1, page_size=1 << 21,
                   path=vmm_library)


@pytest.mark.slow
def test_fence_registers_and_lowers_for_cuda_aliased_without_an_effect(vmm_library):
    """Aliased to its input, and no effect: an effect takes every step off JAX's C++ dispatch path (with one, the
    H100 showed 6-9 ms more host time per 8B step than paged mode; the cause read from JAX's dispatch code)."""
    import jax
    import jax.numpy as jnp
    from custom_calls import vmm
    vmm.register_fence(vmm_library)
    traced = jax.jit(lambda x: vmm.fence(x * 2)).trace(jnp.zeros((4, 8), jnp.float32))
    assert not traced.jaxpr.effects
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert f"stablehlo.custom_call @{vmm.FENCE_TARGET}(" in text and "has_side_effect = true" not in text
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [], operand_index = 0" \
        in text


def test_the_scheduler_runs_unchanged_on_the_vattention_manager():
    from jaxserve.config import EngineConfig
    from jaxserve.engine.sampling_params import SamplingParams
    from jaxserve.engine.scheduler import Scheduler
    from jaxserve.engine.sequence import PENDING, Sequence, next_seq_id
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, min_prefill_chunk=8, max_model_len=128,
                       block_size=4)
    kv, mapper = make(dict(num_seqs=4, max_model_len=128, block_size=4, token_bytes=1024, num_pages=24,
                           page_size=4096), watermark=0, lookahead_tokens=8)   # 4 tokens a page
    sched, rng, tables, forked = Scheduler(cfg, kv), np.random.default_rng(0), {}, set()
    bps, num_forks = kv.geometry.blocks_per_row, 0
    for step in range(300):
        if len(sched.waiting) < 2:
            prompt = int(rng.integers(4, 60))
            n = 2 if prompt <= 12 else 1   # a fork's copy needs its pages at once (ForkError): short prompts
            sp = SamplingParams(temperature=1.0, n=n, max_tokens=60, seed=1)
            sid = next_seq_id()
            sched.add(Sequence(sid, str(sid), 0, [5] * prompt, 0, sp, seed=1, num_forks_pending=n - 1))
        out = sched.schedule()
        for seq_id, start, ids in out.block_updates:
            tables[seq_id] = tables.get(seq_id, [])[:start] + ids
        dst_rows = {int(d) // bps for d in out.copies[1]} if len(out.copies) else set()
        assert {kv.row_of(c) for c in forked if c in kv.seqs} <= dst_rows, "a fork's copy did not come next step"
        forked = {c.seq_id for c in out.forks}
        for row in out.rows:
            kv_row, end = kv.row_of(row.seq.seq_id), row.start + row.count
            blocks = tables[row.seq.seq_id][:-(-end // 4)]
            assert len(blocks) == -(-end // 4) and all(kv_row * bps <= b < (kv_row + 1) * bps for b in blocks)
            assert mapper.ready[kv_row] >= kv.geometry.pages_for(end), "a step would write an unmapped page"
            if row.samples:
                row.seq.token_ids[-1] = 7
            if row.samples and (row.seq.num_output_tokens >= 20 or rng.random() < 0.05):
                sched.finish(row.seq)
        assert PENDING not in [t for s in sched.running for t in s.token_ids]
        num_forks += len(out.forks)
    assert sched.num_preemptions > 0 and num_forks > 0 and kv.total_mapped <= kv.geometry.num_pages


def test_the_cli_leaves_gpu_memory_to_the_page_pool(monkeypatch):
    """XLA claims most of a GPU when it starts unless told not to; vattention's pool is allocated beside it."""
    from jaxserve.cache.vattention import PREALLOCATE_ENV, xla_claims_gpu_memory
    from jaxserve.cli import prepare_process
    from jaxserve.config import EngineConfig
    monkeypatch.delenv(PREALLOCATE_ENV, raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    prepare_process(EngineConfig())
    assert xla_claims_gpu_memory()   # paged: XLA's default stands
    prepare_process(EngineConfig(kv_backend="vattention", enable_prefix_caching=False))
    assert not xla_claims_gpu_memory()
