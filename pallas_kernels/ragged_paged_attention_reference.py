"""Pure-JAX ragged paged attention: the reference for the kernel and the engine's CPU attention path.

Every token is processed independently: it finds its sequence, then walks that sequence's block-table
columns `kv_blocks_per_step` at a time with an online softmax. Each step gathers only those blocks for
each token ([num_tokens, kv_blocks_per_step * block_size, kv_heads, head_dim]), never the whole context,
and the trip count comes from the longest live sequence rather than from the block table's width.

Contiguous (vAttention) caches, where sequence i's KV is row kv_rows[i] of the cache (block_tables.py says which
blocks that is): `contiguous_ragged_attention_reference` runs the paged reference over
that identity table (the CPU path, as lean as the paged one); `contiguous_slice_reference` reads each row directly
as one slice, no block ids, dense: the test oracle that shares no addressing with either.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.block_tables import identity_block_tables

KV_BLOCKS_PER_STEP = 4  # keys per step = 4 * block_size: few loop trips, a small per-step gather on CPU
# An fp8 cache kept as its bits, as the engine keeps one on a CPU: XLA:CPU has no float8 arithmetic and converts a
# whole f8 array to f16 and back for any op on it, so every cache write would copy the cache twice. The reference
# reads the bits as e4m3; the Pallas kernels take e4m3 caches.
FP8_BITS = jnp.dtype(jnp.uint8)


def cache_values(x: jax.Array) -> jax.Array:
    """Blocks read from a cache, as their values: an fp8 cache's bits as e4m3, any other cache's as they are."""
    return lax.bitcast_convert_type(x, jnp.float8_e4m3fn) if x.dtype == FP8_BITS else x


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "kv_blocks_per_step"))
def ragged_paged_attention_reference(q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, num_seqs, *,
                                     sm_scale: float, sliding_window: int | None = None,
                                     soft_cap: float | None = None,
                                     kv_blocks_per_step: int = KV_BLOCKS_PER_STEP) -> jax.Array:
    """Same contract as `ragged_paged_attention`; computes in float32 (an fp8 cache's blocks are converted as they
    are gathered), returns q's dtype."""
    seq, q_pos, kv_len = locate_tokens(cu_q_lens, kv_lens, jnp.reshape(num_seqs, ()), q.shape[0])
    state = attend_keys(grouped(q, k_cache), k_cache, v_cache, seq, q_pos, kv_len, block_tables=block_tables,
                        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                        kv_blocks_per_step=kv_blocks_per_step)
    return normalized(state, q)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "kv_blocks_per_step"))
def cascade_attention_reference(q, k_cache, v_cache, kv_lens, block_tables, num_seqs, groups, *, sm_scale: float,
                                soft_cap: float | None = None,
                                kv_blocks_per_step: int = KV_BLOCKS_PER_STEP) -> jax.Array:
    """Same contract as `cascade_attention` (decode-only: token i is row i's): each grouped row attends its group's
    shared keys through the group's table row and its own keys [kv_starts, kv_len) through its own, the two
    merged by log-sum-exp; other rows attend all their keys."""
    num_rows = kv_lens.shape[0]
    live = jnp.arange(q.shape[0]) < jnp.reshape(num_seqs, ())
    row = jnp.minimum(jnp.arange(q.shape[0]), num_rows - 1)
    slot = jnp.arange(num_rows)   # position in groups.rows
    grouped_slot = slot < groups.cu_rows[groups.num_groups[0]]
    group_of_row = jnp.full(num_rows, -1, jnp.int32).at[jnp.where(grouped_slot, groups.rows, num_rows)].set(
        jnp.sum(groups.cu_rows[1:][None, :] <= slot[:, None], axis=1, dtype=jnp.int32), mode="drop")
    group = group_of_row[row]
    in_group = live & (group >= 0)
    shared_len = jnp.where(in_group, groups.shared_lens[jnp.maximum(group, 0)], 0)
    kv_len = jnp.where(live, kv_lens[row], 0)
    qg = grouped(q, k_cache)
    attend = functools.partial(attend_keys, qg, k_cache, v_cache, block_tables=block_tables, sm_scale=sm_scale,
                               sliding_window=None, soft_cap=soft_cap, kv_blocks_per_step=kv_blocks_per_step)
    shared = attend(groups.table_rows[jnp.maximum(group, 0)], shared_len - 1, shared_len)
    own = attend(row, kv_len - 1, kv_len, kv_start=jnp.where(in_group, groups.kv_starts[row], 0))
    return normalized(merge_states(shared, own), q)


def grouped(q, k_cache):
    """q as float32 [tokens, kv_heads, q heads per kv head, head_dim]."""
    num_tokens, num_q_heads, head_dim = q.shape
    return q.astype(jnp.float32).reshape(num_tokens, k_cache.shape[2], num_q_heads // k_cache.shape[2], head_dim)


def attend_keys(qg, k_cache, v_cache, seq, q_pos, kv_len, *, block_tables, sm_scale, sliding_window, soft_cap,
                kv_blocks_per_step, kv_start=None):
    """Each token's online softmax (m, l, acc), unnormalised, over its keys [kv_start (0), kv_len), those of
    block-table row seq[token] visible from q_pos[token]."""
    step = functools.partial(attend_blocks, qg=qg, k_cache=k_cache, v_cache=v_cache, seq=seq, q_pos=q_pos,
                             kv_start=jnp.zeros_like(kv_len) if kv_start is None else kv_start, kv_len=kv_len,
                             block_tables=block_tables, sm_scale=sm_scale, sliding_window=sliding_window,
                             soft_cap=soft_cap, blocks=kv_blocks_per_step)
    keys_per_step = kv_blocks_per_step * k_cache.shape[1]
    num_steps = (jnp.max(kv_len) + keys_per_step - 1) // keys_per_step
    init = (jnp.full(qg.shape[:3], -jnp.inf), jnp.zeros(qg.shape[:3]), jnp.zeros(qg.shape))
    return lax.fori_loop(0, num_steps, step, init)


def merge_states(a, b):
    """The online-softmax state of two disjoint key sets' states (log-sum-exp)."""
    m = jnp.maximum(a[0], b[0])
    shift = jnp.where(m == -jnp.inf, 0.0, m)
    wa, wb = jnp.exp(a[0] - shift), jnp.exp(b[0] - shift)
    return m, a[1] * wa + b[1] * wb, a[2] * wa[..., None] + b[2] * wb[..., None]


def normalized(state, q):
    _, denom, acc = state
    out = acc / jnp.where(denom == 0, 1.0, denom)[..., None]  # tokens with no keys (padding) -> 0
    return out.reshape(q.shape).astype(q.dtype)


def locate_tokens(cu_q_lens, kv_lens, num_seqs, num_tokens):
    """Per token: its sequence, its absolute position, and its sequence's kv length (0 for padding)."""
    token = jnp.arange(num_tokens)
    live_ends = jnp.where(jnp.arange(kv_lens.shape[0]) < num_seqs, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    seq = jnp.minimum(jnp.sum(live_ends[None, :] <= token[:, None], axis=1), kv_lens.shape[0] - 1)
    is_live = token < cu_q_lens[num_seqs]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    q_pos = kv_lens[seq] - q_len + token - cu_q_lens[seq]
    return seq, q_pos, jnp.where(is_live, kv_lens[seq], 0)


def masked_scores(qg, k, key, live, q_pos, *, sm_scale, soft_cap, sliding_window):
    """[tokens, kv_heads, group, keys] f32 scores, soft-capped; -inf where a token may not see the key (unwritten,
    in its future, or outside its window)."""
    s = jnp.einsum("tkgd,tnkd->tkgn", qg, k, precision=lax.Precision.HIGHEST) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    visible = live & (key[None, :] <= q_pos[:, None])
    if sliding_window is not None:
        visible &= key[None, :] > q_pos[:, None] - sliding_window
    return jnp.where(visible[:, None, None, :], s, -jnp.inf)


def attend_blocks(step, carry, *, qg, k_cache, v_cache, seq, q_pos, kv_start, kv_len, block_tables, sm_scale,
                  sliding_window, soft_cap, blocks):
    """One online-softmax step over block-table columns [step * blocks, (step + 1) * blocks), keys
    [kv_start, kv_len) only."""
    num_tokens, num_kv_heads, _, head_dim = qg.shape
    block_size = k_cache.shape[1]
    cols = step * blocks + jnp.arange(blocks)
    ids = block_tables[seq[:, None], jnp.minimum(cols, block_tables.shape[1] - 1)[None, :]]
    ids = jnp.clip(ids, 0, k_cache.shape[0] - 1)  # entries past a sequence's end may hold anything
    key = (cols[:, None] * block_size + jnp.arange(block_size)).reshape(-1)
    live = (key[None, :] < kv_len[:, None]) & (key[None, :] >= kv_start[:, None])  # slots past kv_len: never written
    k = cache_values(k_cache[ids]).reshape(num_tokens, -1, num_kv_heads, head_dim).astype(jnp.float32)
    v = cache_values(v_cache[ids]).reshape(num_tokens, -1, num_kv_heads, head_dim).astype(jnp.float32)
    v = jnp.where(live[..., None, None], v, 0.0)
    s = masked_scores(qg, k, key, live, q_pos, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    m_prev, l_prev, acc = carry
    m = jnp.maximum(m_prev, s.max(-1))
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)  # rows with nothing visible yet stay all-zero, not NaN
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m_prev - m_safe)
    pv = jnp.einsum("tkgn,tnkd->tkgd", p, v, precision=lax.Precision.HIGHEST)
    return m, l_prev * alpha + p.sum(-1), acc * alpha[..., None] + pv


def contiguous_ragged_attention_reference(q, k_cache, v_cache, cu_q_lens, kv_lens, kv_rows, num_seqs, *,
                                          blocks_per_row: int, num_layers: int = 1, layer=0,
                                          **options) -> jax.Array:
    """Same contract as `contiguous_ragged_attention`: the paged reference over the rows' identity table."""
    return ragged_paged_attention_reference(q, k_cache, v_cache, cu_q_lens, kv_lens,
                                            identity_block_tables(kv_rows, blocks_per_row, num_layers, layer),
                                            num_seqs, **options)


@functools.partial(jax.jit, static_argnames=("blocks_per_row", "num_layers", "sm_scale", "sliding_window",
                                             "soft_cap"))
def contiguous_slice_reference(q, k_cache, v_cache, cu_q_lens, kv_lens, kv_rows, num_seqs, *, blocks_per_row: int,
                               sm_scale: float, num_layers: int = 1, layer=0, sliding_window: int | None = None,
                               soft_cap: float | None = None) -> jax.Array:
    """`contiguous_ragged_attention_reference` written directly: each token reads its sequence's whole row of the
    cache viewed as [rows, blocks_per_row, num_layers, block_size, kv_heads, head_dim] at `layer`, and attends its
    first kv_len keys. Memory [num_tokens, row length, kv_heads, head_dim]: for tests and small shapes."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    seq, q_pos, kv_len = locate_tokens(cu_q_lens, kv_lens, jnp.reshape(num_seqs, ()), num_tokens)

    def rows(c):  # [rows, keys, kv_heads, head_dim] at `layer`
        c = c.reshape(-1, blocks_per_row, num_layers, *c.shape[1:])
        return jnp.take(c, layer, axis=2).reshape(c.shape[0], -1, num_kv_heads, head_dim)
    k, v = (rows(c)[kv_rows[seq]].astype(jnp.float32) for c in (k_cache, v_cache))  # [tokens, keys, kv_heads, head_dim]
    key = jnp.arange(k.shape[1])
    live = key[None, :] < kv_len[:, None]
    v = jnp.where(live[..., None, None], v, 0.0)  # keys past kv_len were never written (NaN x 0 would leak)
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    s = masked_scores(qg, k, key, live, q_pos, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))  # padding tokens see no key: zeros, not NaN
    out = jnp.einsum("tkgn,tnkd->tkgd", p, v, precision=lax.Precision.HIGHEST)
    out = out / jnp.maximum(p.sum(-1), jnp.finfo(jnp.float32).tiny)[..., None]
    return out.reshape(q.shape).astype(q.dtype)
