"""The inputs of one engine step, static-shape (padded to a token bucket T and a sequence bucket S), and the one
builder that makes them: for the runner's steps, its compile-time dummies and the bucket sweep alike.

A step runs up to three compiled graphs, each keyed by its own few static values: the model (T, S, decode-only, W),
the sampler (S, sampler mode, logprobs, constrained, W) and, for prompt logprobs only, the all-position logprobs (T);
W is the positions each row samples at (1; a speculative step's draft width + 1). The model
graph never depends on how requests sample, so sampling options never multiply the expensive graphs."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import numpy as np

from jaxserve.engine.sampler import SamplingTensors, make_sampling_tensors
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.models.attention import AttentionBatch
from pallas_kernels.cascade_attention import CascadeGroups


def static(default):
    return field(default=default, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclass(slots=True)
class ModelInputs:
    token_ids: jax.Array        # [T]
    positions: jax.Array        # [T]
    attn: AttentionBatch
    logits_indices: jax.Array   # [S * W] flat index of the token whose logits each row samples at each of W positions
    prev_index: jax.Array       # [T] row of the previous step whose sample this input is; -1: token_ids has it
    # [S] EAGLE-3 engines: where the features before each row's first token are (engine/drafter.py); -1: nowhere
    feature_index: jax.Array | None = None

    @property
    def key(self) -> tuple:
        rows, cascade = len(self.attn.kv_lens), self.attn.cascade
        return (len(self.token_ids), rows, self.attn.decode_only, len(self.logits_indices) // rows,
                0 if cascade is None else len(cascade.shared_lens))


@jax.tree_util.register_dataclass
@dataclass(slots=True)
class SamplerInputs:
    sampling: SamplingTensors
    slot_ids: jax.Array         # [S] persistent slot of each row (padding: the scratch slot)
    sample_mask: jax.Array      # [S]
    num_logprobs: int = static(0)       # top-k logprobs returned per row (0 or MAX_LOGPROBS)
    mode: str = static("filter")        # config.SAMPLER_MODES
    constrained: bool = static(False)   # rows under structured outputs: token_bitmask is given before it runs
    token_bitmask: jax.Array | None = None   # [S, ceil(V / 32)] int32, structured_outputs.StructuredOutputs.fill
    # speculative steps: [S, W - 1] each row's drafts (-1 padded); the other fields are then per (row, position),
    # [S * W] (sampler.verify)
    draft_ids: jax.Array | None = None

    @property
    def width(self) -> int:
        return 1 if self.draft_ids is None else self.draft_ids.shape[1] + 1

    @property
    def key(self) -> tuple:
        return len(self.slot_ids) // self.width, self.mode, self.num_logprobs, self.constrained, self.width


@dataclass(slots=True)
class StepInputs:
    model: ModelInputs
    sampler: SamplerInputs
    next_prompt_ids: np.ndarray | None = None   # [T] the prompt token after each input token; None: no prompt logprobs


def build_step_inputs(*, num_tokens: int, num_seqs: int, block_size: int, scratch_slot: int,
                      block_tables: np.ndarray | None = None, kv_rows: np.ndarray | None = None,
                      blocks_per_row: int | None = None, starts: Sequence[int] = (), counts: Sequence[int] = (),
                      token_ids: Sequence[int] = (), slots: Sequence[int] = (), sample_mask: Sequence[bool] = (),
                      params: Sequence[SamplingParams] = (), seeds: Sequence[int] = (),
                      num_generated: Sequence[int] = (), eos_token_ids: Sequence[int] = (),
                      logits_from: Sequence[int] | None = None, prev_index: np.ndarray | None = None,
                      next_prompt_ids: np.ndarray | None = None, decode_only: bool = False, num_logprobs: int = 0,
                      sampler_mode: str = "filter", constrained: bool = False,
                      draft_ids: Sequence[Sequence[int]] | None = None, spec_width: int = 1,
                      feature_index: Sequence[int] | None = None, cascade_groups: int = 0,
                      shared: Sequence[tuple[np.ndarray, int]] = ()) -> StepInputs:
    """Host (numpy) inputs of one step over n real rows (decodes first), padded to the buckets.

    Per row: `starts` (first position computed), `counts` (tokens computed), where its KV lies — `block_tables`
    [n, W] (its blocks) or, for contiguous kernels, `kv_rows` [n] (its cache row, of `blocks_per_row` blocks) —
    `slots`, `sample_mask`, `params` / `seeds` / `num_generated` (sampling), `logits_from` (row whose logits it
    samples; -1: its own), `feature_index` (EAGLE-3 engines). Per real token, flattened: `token_ids`,
    `prev_index`, `next_prompt_ids`. cascade_groups > 0: a decode-only step's rows grouped by shared leading blocks,
    `shared` (rows, shared tokens) as `share_prefixes` finds them, padded to that many groups.
    No rows: an all-padding step (its writes land in the null block), as compile-time dummies use.
    """
    counts, starts = np.asarray(counts, np.int32), np.asarray(starts, np.int32)
    n_rows, n_tok = len(counts), int(counts.sum())
    cu = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(counts, out=cu[1:n_rows + 1])
    cu[n_rows + 1:] = cu[n_rows]
    row_of_token = np.repeat(np.arange(n_rows), counts)
    positions = pad(np.arange(n_tok) - np.repeat(cu[:n_rows] - starts, counts), num_tokens)
    pos = positions[:n_tok]
    slot_mapping, block_tables, kv_rows = cache_addressing(
        pos, row_of_token, num_tokens=num_tokens, num_seqs=num_seqs, block_size=block_size,
        block_tables=block_tables, kv_rows=kv_rows, blocks_per_row=blocks_per_row)
    num_drafts = np.array([len(d) for d in draft_ids] if draft_ids is not None else [0] * n_rows, np.int32)
    own_last = np.maximum(cu[1:n_rows + 1] - 1, 0) - num_drafts   # each row's last known token
    from_row = np.arange(n_rows) if logits_from is None else np.where(np.asarray(logits_from) < 0,
                                                                      np.arange(n_rows), logits_from)
    after = np.minimum(np.arange(spec_width)[None, :], num_drafts[:, None])   # [n, W]: drafts before each position
    attn = AttentionBatch(slot_mapping, cu, pad(starts + counts, num_seqs), block_tables, np.array([n_rows], np.int32),
                          decode_only, kv_rows,
                          cascade_inputs(shared, num_seqs, cascade_groups) if cascade_groups else None)
    model = ModelInputs(pad(token_ids, num_tokens), positions, attn,
                        pad(own_last[from_row][:, None] + after, num_seqs).reshape(-1),
                        pad(prev_index if prev_index is not None else [], num_tokens, fill=-1),
                        None if feature_index is None else pad(feature_index, num_seqs, fill=-1))
    if spec_width == 1:   # a position a row: the rows' own values
        per_position, gen_indices, in_row = (lambda values: values), num_generated, sample_mask
    else:
        per_position = lambda values: [v for v in values for _ in range(spec_width)]   # noqa: E731
        gen_indices = [g + j for g in num_generated for j in range(spec_width)]
        in_row = [m and j <= k for m, k in zip(sample_mask, num_drafts) for j in range(spec_width)]
    sampling = make_sampling_tensors(per_position(params), per_position(seeds), gen_indices,
                                     num_rows=num_seqs * spec_width, eos_token_ids=eos_token_ids)
    sampler = SamplerInputs(sampling, pad(per_position(slots), num_seqs * spec_width, fill=scratch_slot),
                            pad(in_row, num_seqs * spec_width, dtype=bool), num_logprobs, sampler_mode, constrained,
                            draft_ids=None if spec_width == 1 else padded_drafts(draft_ids or [], num_seqs, spec_width))
    prompt = None if next_prompt_ids is None else pad(next_prompt_ids, num_tokens, fill=-1)
    return StepInputs(model, sampler, prompt)


# Each array of a packed buffer starts at a multiple of this many bytes, as XLA's own buffers do on a GPU: the
# graph's unpacked arrays are views of the buffer, and a GPU kernel may refuse one that is not aligned.
PACK_ALIGN = 256


def aligned(num_bytes: int) -> int:
    return -(-num_bytes // PACK_ALIGN) * PACK_ALIGN


def pack(tree) -> np.ndarray:
    """tree's host arrays as one byte buffer, one after another (each from a multiple of PACK_ALIGN): a step's
    model inputs go to the device as one transfer and its sampler inputs as another, where each array of its own
    would cost a transfer's fixed host time (`Layout` reads them back in a graph)."""
    leaves = [np.ascontiguousarray(x).view(np.uint8).reshape(-1) for x in jax.tree.leaves(tree)]
    packed, at = np.zeros(sum(aligned(x.size) for x in leaves), np.uint8), 0
    for x in leaves:
        packed[at:at + x.size] = x
        at += aligned(x.size)
    return packed


def unpack(packed: jax.Array, layout: Sequence[tuple[tuple[int, ...], str]]) -> list[jax.Array]:
    """The arrays `pack` joined, by their (shape, dtype) in order (traced: slices and bitcasts of packed)."""
    leaves, at = [], 0
    for shape, dtype in layout:
        dtype = np.dtype(dtype)
        size = math.prod(shape) * dtype.itemsize
        raw = packed[at:at + size]
        at += aligned(size)
        if dtype == np.bool_:
            value = raw != 0
        else:
            value = jax.lax.bitcast_convert_type(raw.reshape(-1, dtype.itemsize) if dtype.itemsize > 1 else raw, dtype)
        leaves.append(value.reshape(shape))
    return leaves


def layout_of(leaves) -> tuple[tuple[tuple[int, ...], str], ...]:
    """(shape, dtype) of each array: unpack's layout, hashable."""
    return tuple((tuple(x.shape), np.dtype(x.dtype).name) for x in leaves)


class Layout(NamedTuple):
    """Where one part of a packed step lies: the part's pytree structure and its leaves' (shape, dtype); hashable,
    a graph's static argument."""
    treedef: jax.tree_util.PyTreeDef
    leaves: tuple

    @staticmethod
    def of(tree) -> Layout:
        leaves, treedef = jax.tree.flatten(tree)
        return Layout(treedef, layout_of(leaves))

    @property
    def num_bytes(self) -> int:
        return sum(aligned(math.prod(shape) * np.dtype(dtype).itemsize) for shape, dtype in self.leaves)

    def unpack(self, packed: jax.Array):
        """The part from its bytes (traced)."""
        return self.treedef.unflatten(unpack(packed, self.leaves))


def share_prefixes(block_tables: np.ndarray, kv_lens: np.ndarray, block_size: int, max_groups: int,
                   min_members: int = 2) -> list[tuple[np.ndarray, int]]:
    """Decode rows grouped by their first block, each group's shared prefix the leading blocks all its members hold
    (whole blocks before every member's newest token): (rows, shared tokens) of the max_groups groups of
    min_members or more whose shared reads save most (shared tokens x (members - 1))."""
    first = block_tables[:, 0]
    order = np.argsort(first, kind="stable")
    _, starts, sizes = np.unique(first[order], return_index=True, return_counts=True)
    groups = []
    large = sizes >= max(min_members, 2)
    for start, size in zip(starts[large], sizes[large]):
        rows = order[start:start + size]
        limit = int(((kv_lens[rows] - 1) // block_size).min())
        if limit == 0:
            continue
        differs = (block_tables[rows, :limit] != block_tables[rows[0], :limit]).any(axis=0)
        shared = (int(differs.argmax()) if differs.any() else limit) * block_size
        if shared:
            groups.append((shared * (size - 1), rows, shared))
    groups.sort(key=lambda g: -g[0])
    return [(rows, shared) for _, rows, shared in groups[:max_groups]]


def cascade_inputs(shared: Sequence[tuple[np.ndarray, int]], num_seqs: int, num_groups: int) -> CascadeGroups:
    """CascadeGroups of `shared` groups padded to num_seqs rows and num_groups groups."""
    kv_starts, sizes = np.zeros(num_seqs, np.int32), [len(rows) for rows, _ in shared]
    for rows, tokens in shared:
        kv_starts[rows] = tokens
    cu = np.zeros(num_groups + 1, np.int32)
    np.cumsum(sizes, out=cu[1:len(sizes) + 1])
    cu[len(sizes) + 1:] = cu[len(sizes)]
    members = np.concatenate([rows for rows, _ in shared]) if shared else np.zeros(0, np.int32)
    return CascadeGroups(kv_starts, pad(members, num_seqs), cu, pad([t for _, t in shared], num_groups),
                         pad([rows[0] for rows, _ in shared], num_groups), np.array([len(shared)], np.int32))


def padded_drafts(draft_ids: Sequence[Sequence[int]], num_seqs: int, spec_width: int) -> np.ndarray:
    """[num_seqs, spec_width - 1] each row's drafts, -1 padded."""
    out = np.full((num_seqs, spec_width - 1), -1, np.int32)
    for row, drafts in enumerate(draft_ids):
        out[row, :len(drafts)] = drafts
    return out


def cache_addressing(pos: np.ndarray, row_of_token: np.ndarray, *, num_tokens: int, num_seqs: int, block_size: int,
                     block_tables: np.ndarray | None, kv_rows: np.ndarray | None, blocks_per_row: int | None):
    """Padded (slot_mapping [T]: the cache slot each token's K/V is written to, block_tables [S, W] or None,
    kv_rows [S] or None): block tables, or (contiguous kernels) each row's cache row."""
    if kv_rows is None:
        slot_mapping = block_tables[row_of_token, pos // block_size] * block_size + pos % block_size
        return pad(slot_mapping, num_tokens), pad(block_tables, num_seqs), None
    # a row's tokens lie in order from its first block on: its cache row's base + the position, no block ids
    slot_mapping = kv_rows[row_of_token] * (blocks_per_row * block_size) + pos
    return pad(slot_mapping, num_tokens), None, pad(kv_rows, num_seqs)


def pad(values, size: int, fill=0, dtype=np.int32) -> np.ndarray:
    """values (along the first axis) followed by `fill` up to `size`."""
    values = np.asarray(values, dtype)
    out = np.full((size, *values.shape[1:]), fill, dtype)
    out[:len(values)] = values
    return out
