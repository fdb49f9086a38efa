"""Cascade attention on Hopper (sm_90a) without Pallas's Triton backend: the Mosaic GPU decode kernel
(`paged_decode_attention_mgpu`) run twice for float32 partials, merged exactly by log-sum-exp in XLA.

- Shared pass: each group's members are packed TILE_ROWS // group to a tile, a virtual decode whose q heads of a
  kv head are its members' (a GQA group of members x group), over the group's shared blocks (the row `table_rows`
  names): the prefix is read once per tile of members, not once per member.
- Own pass: each row's keys past its group's shared ones, through its block table shifted by the shared blocks
  (shared lengths are whole blocks, and decode attention does not depend on where a key sits); rows outside every
  group attend their whole context. Its partials come from the Mosaic GPU decode or from `own_partials` (the
  engine's CUDA call, faster at large batches and over FP8 caches).
- Merge: each row's shared splits, gathered from the packed tiles, join its own pass's in one weighed sum.
No sliding window (as `cascade_attention`). Reference: `cascade_attention_reference`.
"""
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels.cascade_attention import CascadeGroups
from pallas_kernels.paged_decode_attention_mgpu import TILE_ROWS, DecodeTuning, decode_partials, merge_partials


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class MemberTiles:
    """The shared pass's virtual decodes: group members packed `members` to a tile, tiles of a group consecutive."""
    rows: jax.Array         # [T, members] the member rows of each tile, -1 where none
    group: jax.Array        # [T] each tile's group (0 past the live tiles)
    count: jax.Array        # [] live tiles
    slot_of_row: jax.Array  # [S] each row's place (tile * members + member), T * members for rows in no group


def cascade_decode_attention(q, k_cache, v_cache, kv_lens, block_tables, num_decodes, groups: CascadeGroups, *,
                             sm_scale: float, soft_cap: float | None = None, tuning: DecodeTuning = DecodeTuning(),
                             interpret: bool = False, own_partials=None):
    """`paged_decode_attention` (token i is decode i's query) over a batch whose rows share leading blocks as
    `groups` says; the same output, each shared prefix read once per tile of its members. own_partials: None (the
    Mosaic GPU decode) or a function (q, k_cache, v_cache, kv_lens, block_tables, *, sm_scale, soft_cap) ->
    decode_partials' pair over those rows (rows past the decodes get kv_len 0)."""
    num_tokens, num_q_heads, _ = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    members = TILE_ROWS // (num_q_heads // kv_heads)
    options = {"sm_scale": sm_scale, "soft_cap": soft_cap, "tuning": tuning, "interpret": interpret}
    tiles = member_tiles(groups, members)
    # tiles past tiles.count are no decodes: the kernel reads none of their keys
    parts, lse = decode_partials(packed_queries(q, tiles.rows, kv_heads), k_cache, v_cache,
                                 groups.shared_lens[tiles.group], block_tables[groups.table_rows[tiles.group]],
                                 tiles.count, **options)
    shared, shared_lse = unpacked(parts, lse, tiles.slot_of_row, kv_heads, members)
    own_tables = shifted_tables(block_tables, groups.kv_starts // block_size)
    own_lens = kv_lens - groups.kv_starts
    if own_partials is None:
        parts, lse = decode_partials(q, k_cache, v_cache, own_lens, own_tables, num_decodes, **options)
    else:
        rows = min(q.shape[0], own_lens.shape[0])
        own_lens = jnp.where(jnp.arange(rows) < num_decodes, own_lens[:rows], 0)
        parts, lse = own_partials(q[:rows], k_cache, v_cache, own_lens, own_tables[:rows], sm_scale=sm_scale,
                                  soft_cap=soft_cap)
    rows = parts.shape[0]
    out, _ = merge_partials(jnp.concatenate([parts, shared[:rows]], axis=1),
                            jnp.concatenate([lse, shared_lse[:rows]], axis=1))
    return jnp.pad(out, ((0, num_tokens - rows), (0, 0), (0, 0))).astype(q.dtype)


def member_tiles(groups: CascadeGroups, members: int) -> MemberTiles:
    """Group g's rows (groups.rows[cu_rows[g]:cu_rows[g + 1]]) in tiles of `members`, its last one partial. Static
    bound: every live group may end mid-tile."""
    num_rows, num_groups = groups.rows.shape[0], groups.shared_lens.shape[0]
    num_tiles = num_rows // members + num_groups + 1
    cu = groups.cu_rows
    sizes = jnp.where(jnp.arange(num_groups) < groups.num_groups[0], cu[1:] - cu[:-1], 0)
    group_tiles = -(-sizes // members)
    tile_end = jnp.cumsum(group_tiles)
    tile_start = tile_end - group_tiles
    place = jnp.arange(num_rows)
    is_member = place < cu[groups.num_groups[0]]
    group = jnp.minimum(jnp.searchsorted(cu[1:], place, side="right", method="compare_all"), num_groups - 1)
    rank = place - cu[group]
    slot = jnp.where(is_member, (tile_start[group] + rank // members) * members + rank % members,
                     num_tiles * members)
    rows = jnp.full((num_tiles * members,), -1, jnp.int32).at[slot].set(groups.rows, mode="drop")
    slot_of_row = jnp.full((num_rows,), num_tiles * members, jnp.int32).at[
        jnp.where(is_member, groups.rows, num_rows)].set(slot, mode="drop")
    tile_group = jnp.searchsorted(tile_end, jnp.arange(num_tiles), side="right", method="compare_all")
    return MemberTiles(rows.reshape(num_tiles, members), jnp.where(tile_group < num_groups, tile_group, 0),
                       tile_end[-1], slot_of_row)


def packed_queries(q, tile_rows, kv_heads: int):
    """[T, kv_heads * members * group, head_dim]: kv head h's q heads of tile t are its members' (in order), each
    member's `group` q heads of h in turn. Empty places take row 0's (their outputs are never read)."""
    num_tiles, members = tile_rows.shape
    _, num_q_heads, head_dim = q.shape
    packed = q[jnp.maximum(tile_rows, 0)].reshape(num_tiles, members, kv_heads, num_q_heads // kv_heads, head_dim)
    return packed.transpose(0, 2, 1, 3, 4).reshape(num_tiles, -1, head_dim)


def unpacked(parts, lse, slot_of_row, kv_heads: int, members: int):
    """The shared pass's partials [T, splits, packed heads, head_dim] and log2-sum-exps [T, splits, packed heads] as
    each row's [S, splits, q heads, head_dim] and [S, splits, q heads], gathered unmerged: only the rows' data moves
    (T counts a tile for every group the step could hold), merged once with the own pass's; rows in no group get no
    keys (zeros, -inf)."""
    num_tiles, splits, packed_heads, head_dim = parts.shape
    group = packed_heads // (kv_heads * members)
    tile, member = slot_of_row // members, slot_of_row % members   # no group: tile T, out of range
    out = parts.reshape(num_tiles, splits, kv_heads, members, group, head_dim).at[tile, :, :, member].get(
        mode="fill", fill_value=0)
    lse = lse.reshape(num_tiles, splits, kv_heads, members, group).at[tile, :, :, member].get(
        mode="fill", fill_value=-jnp.inf)
    return out.reshape(-1, splits, kv_heads * group, head_dim), lse.reshape(-1, splits, kv_heads * group)


def shifted_tables(block_tables, first_blocks):
    """Each row's block table from its block first_blocks[row] on (the tail repeats its last entry: keys there are
    past the row's own keys, never attended)."""
    cols = jnp.arange(block_tables.shape[1])[None, :] + first_blocks[:, None]
    return jnp.take_along_axis(block_tables, jnp.minimum(cols, block_tables.shape[1] - 1), axis=1)
