"""Device-side KV cache: slot writes, batched block copies, in-place donation, COW and prefix hits on real arrays."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

import custom_calls
from custom_calls import cpu as cpu_calls
import pytest

from jaxserve.cache import kv_cache
from jaxserve.cache.kv_cache import (VAttentionCache, allocate_kv_cache, copy_blocks, describe_kv_capacity,
                                     from_layer_blocks, kv_bytes_per_block, layer_blocks, layer_of,
                                     layer_slot_mapping, num_blocks_for_memory, pad_block_copies, with_layer,
                                     write_kv)
from jaxserve.cache.kv_cache_manager import KVCacheManager

NB, BS, H, D = 32, 4, 2, 8


def poisoned_cache(num_layers=2, dtype=jnp.float32):
    return [(jnp.full((NB, BS, H, D), jnp.nan, dtype), jnp.full((NB, BS, H, D), jnp.nan, dtype))
            for _ in range(num_layers)]


def step(cache, k, v, slots):
    """A stand-in for the model step: every layer writes its K/V (layer-scaled) into the donated cache."""
    return [write_kv(kc, vc, k * (i + 1), v * (i + 1), slots) for i, (kc, vc) in enumerate(cache)]


jit_step = jax.jit(step, donate_argnums=0)


def token_kv(token_ids, positions, seed=0):
    """Deterministic per-(token, position) K/V: what a model would write for those tokens."""
    rng = np.random.default_rng(seed)
    tok_tab, pos_tab = rng.standard_normal((2, 64, H, D), dtype=np.float32)
    k = tok_tab[np.asarray(token_ids) % 64] + pos_tab[np.asarray(positions) % 64]
    return jnp.asarray(k), jnp.asarray(-k)


def slots_of(manager, seq_id, start, end):
    blocks = np.asarray(manager.block_ids(seq_id))
    pos = np.arange(start, end)
    return jnp.asarray(blocks[pos // BS] * BS + pos % BS, jnp.int32)


def copy(cache, src, dst):
    """copy_blocks as the runner calls it: ids padded to a bucket; no copies, no call."""
    num_blocks = cache.k.shape[0] if isinstance(cache, VAttentionCache) else cache[0][0].shape[0]
    return copy_blocks(cache, *pad_block_copies(src, dst, num_blocks)) if len(src) else cache


def run_writes(cache, manager, writes):
    """One engine step: this step's COW copies first (one call), then every (seq, tokens, start) write."""
    src, dst = manager.take_copies()
    cache = copy(cache, src, dst)
    for seq_id, tokens, start in writes:
        end = len(tokens)
        k, v = token_kv(tokens[start:end], np.arange(start, end))
        cache = jit_step(cache, k, v, slots_of(manager, seq_id, start, end))
    return cache


def seq_kv(cache, manager, seq_id, n, layer=0):
    k = np.asarray(cache[layer][0])[np.asarray(manager.block_ids(seq_id))].reshape(-1, H, D)
    return k[:n]


# --- write_kv --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_matches_numpy_scatter(dtype):
    rng = np.random.default_rng(1)
    slots = rng.choice(np.arange(BS, NB * BS), size=11, replace=False).astype(np.int32)
    slots = np.concatenate([slots, [0, 0, 0]]).astype(np.int32)  # bucket padding -> null block
    k, v = rng.standard_normal((2, len(slots), H, D), dtype=np.float32)
    cache = poisoned_cache(1, dtype)
    (kc, vc), = jit_step(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    got_k, got_v = (np.asarray(x.astype(jnp.float32)).reshape(NB * BS, H, D) for x in (kc, vc))
    want_k = np.asarray(jnp.asarray(k).astype(dtype).astype(jnp.float32))
    want_v = np.asarray(jnp.asarray(v).astype(dtype).astype(jnp.float32))
    np.testing.assert_array_equal(got_k[slots[:11]], want_k[:11])
    np.testing.assert_array_equal(got_v[slots[:11]], want_v[:11])
    untouched = np.setdiff1d(np.arange(BS, NB * BS), slots)
    assert np.isnan(got_k[untouched]).all() and np.isnan(got_v[untouched]).all()


def test_write_kv_rejects_mismatched_shapes():
    kc, vc = poisoned_cache(1)[0]
    with pytest.raises(ValueError, match=r"k must be \(4, 2, 8\)"):
        write_kv(kc, vc, jnp.zeros((3, H, D)), jnp.zeros((3, H, D)), jnp.zeros(4, jnp.int32))


def test_cache_writes_and_copies_run_the_custom_calls_where_they_run():
    """One implementation each: on an NVIDIA GPU the step's writes and the copy-on-write copies are the CUDA
    custom calls (measured faster: benchmarks/NOTES_cuda.md), under the CPU backend the CPU library's (XLA:CPU's
    scatter costs tens of microseconds a layer), elsewhere their pure-JAX references."""
    cache, idx = poisoned_cache(1), jnp.zeros(kv_cache.COPY_BUCKET_MIN, jnp.int32)
    k, v = token_kv([1, 2, 3], [0, 1, 2])
    write_hlo = jit_step.lower(cache, k, v, jnp.asarray([4, 5, 6], jnp.int32)).as_text()
    copy_hlo = kv_cache.copy_blocks.lower(cache, idx, idx).as_text()
    in_place = custom_calls.available() or cpu_calls.available()
    assert custom_calls.moves_in_place(jnp.float32) == in_place
    assert ("jaxserve_reshape_and_cache" in write_hlo) == in_place
    assert ("jaxserve_copy_blocks" in copy_hlo) == in_place


# --- donation: the compiled step updates the cache in place -------------------------------------------------------


def assert_cache_aliased_without_copy(hlo: str, num_leaves: int):
    header = hlo.splitlines()[0]
    assert "input_output_alias" in header
    for i in range(num_leaves):  # output i reuses parameter i: the cache leaves
        assert f"{{{i}}}: ({i}, {{}}" in header
    cache_shape = f"[{NB},{BS},{H},{D}]"
    copies = [line for line in hlo.splitlines() if " copy(" in line and cache_shape in line.split("copy(")[0]]
    assert not copies, copies


def test_step_with_write_kv_updates_donated_cache_in_place():
    cache = poisoned_cache(2)
    k, v = token_kv([1, 2, 3], [0, 1, 2])
    slots = jnp.asarray([4, 5, 6], jnp.int32)
    assert_cache_aliased_without_copy(jit_step.lower(cache, k, v, slots).compile().as_text(), 4)
    ptrs = [x.unsafe_buffer_pointer() for layer in cache for x in layer]
    out = jit_step(cache, k, v, slots)
    assert all(x.is_deleted() for layer in cache for x in layer)
    assert [x.unsafe_buffer_pointer() for layer in out for x in layer] == ptrs


def test_copy_blocks_updates_donated_cache_in_place_in_one_call():
    cache = poisoned_cache(2)
    idx = jnp.zeros(kv_cache.COPY_BUCKET_MIN, jnp.int32)
    assert_cache_aliased_without_copy(kv_cache.copy_blocks.lower(cache, idx, idx).compile().as_text(), 4)
    ptrs = [x.unsafe_buffer_pointer() for layer in cache for x in layer]
    out = copy(cache, np.array([1, 2], np.int32), np.array([3, 4], np.int32))
    assert all(x.is_deleted() for layer in cache for x in layer)
    assert [x.unsafe_buffer_pointer() for layer in out for x in layer] == ptrs


# --- copy_blocks -----------------------------------------------------------------------------------------------


def test_copy_blocks_matches_numpy_and_reads_all_sources_before_writing():
    rng = np.random.default_rng(2)
    data = rng.standard_normal((2, 2, NB, BS, H, D), dtype=np.float32)
    cache = [(jnp.asarray(data[i, 0]), jnp.asarray(data[i, 1])) for i in range(2)]
    src = np.array([5, 6, 7, 9, 3], np.int32)
    dst = np.array([6, 7, 8, 10, 11], np.int32)  # 6 and 7 are read and written: every copy reads the old values
    want = data.copy()
    want[:, :, dst] = data[:, :, src]
    out = copy(cache, src, dst)
    np.testing.assert_array_equal(np.stack([np.stack(layer) for layer in out]), want)
    # 3 and 5 copies pad to one bucket: one compiled graph serves both
    assert pad_block_copies(src[:3], dst[:3], NB)[0].shape == pad_block_copies(src, dst, NB)[0].shape


def test_cross_layer_cache_writes_one_layer_and_copies_every_layer_of_a_block():
    """vattention's megacache: model layer 1's writes land in layer 1 of their blocks only (the layer traced, as the
    model's layers share one trace), and a block copy moves all of a block's layers, in place."""
    rng = np.random.default_rng(4)
    data = rng.standard_normal((2, NB, 3, BS, H, D), dtype=np.float32)
    cache = VAttentionCache(jnp.asarray(data[0]), jnp.asarray(data[1]))
    k, v = token_kv([1, 2, 3], [0, 1, 2])
    slots = jnp.asarray([4 * BS + 1, 4 * BS + 2, 9 * BS], jnp.int32)

    @functools.partial(jax.jit, donate_argnums=0)
    def write(cache, layer, k, v, slots):   # as models/attention.paged_attention writes
        kv_layer = VAttentionCache(cache.k, cache.v, layer)
        kc, vc, num_layers, i = layer_blocks(kv_layer)
        kc, vc = write_kv(kc, vc, k, v, layer_slot_mapping(slots, BS, num_layers, i))
        return with_layer(cache, 1, from_layer_blocks(kv_layer, kc, vc))

    assert int(layer_of(cache, 2).layer) == 2 and layer_of(cache, 2).k is cache.k

    cache = write(cache, jnp.int32(1), k, v, slots)
    want = data.copy()
    want[0, [4, 4, 9], 1, [1, 2, 0]], want[1, [4, 4, 9], 1, [1, 2, 0]] = np.asarray(k), np.asarray(v)
    np.testing.assert_array_equal(np.stack([cache.k, cache.v]), want)
    ptrs = [x.unsafe_buffer_pointer() for x in (cache.k, cache.v)]
    out = copy(cache, np.array([4, 2], np.int32), np.array([7, 4], np.int32))
    want[:, [7, 4]] = want[:, [4, 2]]
    np.testing.assert_array_equal(np.stack([out.k, out.v]), want)
    assert cache.k.is_deleted() and [x.unsafe_buffer_pointer() for x in (out.k, out.v)] == ptrs


def test_block_copies_are_padded_to_a_bucket_and_bad_ids_are_rejected():
    src, dst = pad_block_copies([3, 5], [7, 9], NB)
    assert len(src) == len(dst) == kv_cache.COPY_BUCKET_MIN and list(src[:2]) == [3, 5] and list(dst[:2]) == [7, 9]
    assert (dst[2:] >= NB).all()   # padding pairs write past the cache: skipped
    empty = np.zeros(0, np.int32)
    with pytest.raises(ValueError, match="src and dst"):
        pad_block_copies(np.array([1], np.int32), empty, NB)
    with pytest.raises(ValueError, match="distinct"):
        pad_block_copies(np.array([1, 2], np.int32), np.array([3, 3], np.int32), NB)
    with pytest.raises(ValueError, match=r"\[0, 32\)"):
        pad_block_copies(np.array([1], np.int32), np.array([NB], np.int32), NB)


# --- manager + device arrays: copy-on-write and prefix hits -----------------------------------------------------


def test_forked_sequences_never_see_each_others_tokens():
    m = KVCacheManager(NB, BS, watermark=0)
    cache = poisoned_cache(2)
    prompt = [5, 6, 7, 8, 9, 10]  # 1.5 blocks: the partial last block is shared after the fork
    m.allocate("p", prompt, len(prompt))
    cache = run_writes(cache, m, [("p", prompt, 0)])
    toks = {}
    for child in range(3):
        m.fork("p", child)
    shared = m.block_ids("p")[1]
    assert m.pool.blocks[shared].ref_cnt == 4
    for s in ("p", 0, 1, 2):  # three decode steps, each seq sampling its own tokens
        toks[s] = list(prompt)
    for t in range(3):
        writes = []
        for s in toks:
            toks[s].append(20 + 10 * t + (s if s != "p" else 9))
            assert m.allocate(s, toks[s], 1)[0]
            writes.append((s, toks[s], len(toks[s]) - 1))
        if t == 0:
            assert m.pool.blocks[shared].ref_cnt == 1  # the last sharer writes in place, the others copied
            assert len(m.copies) == 3
        cache = run_writes(cache, m, writes)
    for s, tokens in toks.items():
        for layer in range(2):
            want = np.asarray(token_kv(tokens, np.arange(len(tokens)))[0]) * (layer + 1)
            np.testing.assert_array_equal(seq_kv(cache, m, s, len(tokens), layer), want)


def test_prefix_hit_is_bit_identical_to_recompute():
    prompt = list(range(3, 17))  # 14 tokens: 3 full blocks, 13 // 4 = 3 can hit
    m = KVCacheManager(NB, BS, watermark=0)
    cache = poisoned_cache(2, jnp.bfloat16)
    m.allocate("a", prompt, len(prompt))
    cache = run_writes(cache, m, [("a", prompt, 0)])
    m.free("a")
    other = [40 + i for i in range(20)]  # unrelated traffic reuses free blocks, LRU first
    m.allocate("b", other, len(other))
    cache = run_writes(cache, m, [("b", other, 0)])
    ok, cached = m.allocate("a2", prompt, len(prompt) - 12)
    assert ok and cached == 12
    fresh_m, fresh = KVCacheManager(NB, BS, watermark=0), poisoned_cache(2, jnp.bfloat16)
    fresh_m.allocate("a", prompt, len(prompt))
    fresh = run_writes(fresh, fresh_m, [("a", prompt, 0)])
    for layer in range(2):
        for i in range(2):
            got = np.asarray(cache[layer][i])[m.block_ids("a2")[:3]]
            want = np.asarray(fresh[layer][i])[fresh_m.block_ids("a")[:3]]
            assert not np.isnan(want.astype(np.float32)).any()
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))  # bitwise


# --- sizing --------------------------------------------------------------------------------------------------


def test_kv_bytes_per_block_matches_allocated_arrays():
    cache = allocate_kv_cache(3, NB, BS, H, D, jnp.bfloat16)
    total = sum(k.nbytes + v.nbytes for k, v in cache)
    assert kv_bytes_per_block(3, BS, H, D, jnp.bfloat16) * NB == total == 2 * 3 * NB * BS * H * D * 2
    assert all(k.shape == (NB, BS, H, D) and not k.any() for k, _ in cache)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_bytes_per_block(3, BS, 0, D, jnp.bfloat16)
    with pytest.raises(ValueError, match="num_blocks"):
        allocate_kv_cache(1, 1, BS, H, D, jnp.float32)


def test_allocate_kv_cache_places_on_given_sharding():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    (k, v), = allocate_kv_cache(1, NB, BS, H, D, jnp.float32, sharding)
    assert k.sharding == sharding and v.sharding == sharding


class StatsDevice:
    """A device whose allocator reports fixed stats: checks the sizing arithmetic."""

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_num_blocks_from_device_memory_stats():
    dev = StatsDevice({"bytes_limit": 80 << 30, "bytes_in_use": 16 << 30})
    per_block = 2 << 20
    want = int((64 << 30) - (4 << 30)) * 0.5 // per_block
    assert num_blocks_for_memory(per_block, device=dev, activation_peak_bytes=4 << 30, fraction=0.5) == want
    with pytest.raises(ValueError, match="need >= 2"):
        num_blocks_for_memory(per_block, device=StatsDevice({"bytes_limit": 1 << 20, "bytes_in_use": 0}))
    with pytest.raises(ValueError, match="fraction"):
        num_blocks_for_memory(per_block, device=dev, fraction=0.0)


def test_num_blocks_on_host_memory_is_a_capped_fraction(monkeypatch):
    assert kv_cache.available_host_bytes() > 0
    monkeypatch.setattr(kv_cache, "available_host_bytes", lambda: 10 << 30)
    per_block = kv_bytes_per_block(32, 16, 8, 128, jnp.bfloat16)  # Llama-3-8B: 2 MiB per block
    cpu = StatsDevice(None)  # like a CPU device: no allocator stats
    assert num_blocks_for_memory(per_block, device=cpu, cpu_fraction=0.25, cpu_max_bytes=100 << 30) == 1280
    assert num_blocks_for_memory(per_block, device=cpu, cpu_fraction=0.25, cpu_max_bytes=1 << 30) == 512
    assert num_blocks_for_memory(per_block, device=cpu, activation_peak_bytes=1 << 30, cpu_max_bytes=2 << 30) == 512
    assert (describe_kv_capacity(512, 16, per_block, jnp.bfloat16)
            == "KV cache (bfloat16): 511 blocks x 16 = 8,176 tokens (1.00 GiB)")


