"""The draft models of speculative decoding: a smaller model with the target's tokenizer (speculative_config method
"draft") or an EAGLE-3 head (method "eagle3", models/eagle3.py) proposes each decoding sequence's next tokens
greedily, which the target's step verifies.

Its KV lies in more layers of the target's paged cache (cache/kv_backend.py PagedKV): the same block of a sequence
holds both models' KV of its tokens, so the block tables, the block manager's count, prefix-cache hits and
copy-on-write serve both. Every model step of a seq bucket that speculation runs in computes the draft's KV of
the step's tokens beside the target's (`write_draft_kv`, inside the model graph), so before a speculative step the
draft's cache covers every token the target computed; `draft_tokens` then runs the k greedy draft steps of a batch
as one graph (one launch), from each row's last token, whose blocks (and lookahead blocks) the scheduler has
already allocated. Steps of more rows (they never speculate) skip the draft, which would cost each its share of the
weights, and their graphs take only the target's cache layers: tokens computed there are holes in the draft's
cache, which lower the acceptance of their sequences, never their output (verification is exact).

An EAGLE-3 head's entry at position p is (the token at p + 1, the target's features at p): the model graph writes
the entries of positions start - 1 .. end - 2 of each row, whose next tokens it has (`write_eagle_kv`), and keeps
the features of the positions it computes logits at (`features`, [rows x W, H], on the device); the features of
position start - 1 come from there (`feature_index`, found by the host from the previous step's rows). Drafting
starts from each row's last token and the features before it, then feeds the head's own output back."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache.kv_cache import layer_of, with_layer
from jaxserve.config import SpeculativeConfig
from jaxserve.engine.step_inputs import pad
from jaxserve.models.attention import AttentionBatch, AttentionKernels, PagedAttention
from jaxserve.models.eagle3 import load_eagle3
from jaxserve.models.loader import LoadedModel, load_model


def load_draft(spec: SpeculativeConfig, target: LoadedModel) -> LoadedModel:
    """The draft model (or EAGLE-3 head) on the target's devices, in its dtype; refused when its tokens would not
    be the target's."""
    if jax.process_count() > 1:
        raise ValueError(f"speculative_config method {spec.method!r} runs on one host: its drafts are proposed "
                         "outside the steps that every process replays; use method 'ngram' on a multi-host engine")
    if spec.method == "eagle3":
        return load_eagle3(spec.model, target)
    print(f"loading the draft model {spec.model}", file=sys.stderr)
    draft = load_model(spec.model, target.dtype, target.mesh)
    if draft.config.vocab_size > target.config.vocab_size:
        raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of {draft.config.vocab_size} "
                         f"tokens, the model {target.config.vocab_size}: a draft model must share the model's "
                         "tokenizer")
    if draft.tokenizer is not None and target.tokenizer is not None and \
            draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"speculative_config.model {spec.model!r} has another tokenizer than the model: a draft "
                         "model must share the model's tokenizer")
    return draft


@jax.tree_util.register_dataclass
@dataclass(slots=True)
class DraftInputs:
    """A drafting batch of S rows (padded): each row's last token, its position, its block table and how many
    tokens to draft (0: a padding row)."""
    token_ids: jax.Array      # [S]
    positions: jax.Array      # [S]
    block_tables: jax.Array   # [S, max_blocks_per_seq]
    num_drafts: jax.Array     # [S]
    num_seqs: jax.Array       # [1] real rows
    feature_index: jax.Array  # [S] EAGLE-3: where the features before each row's last token are; -1: nowhere


def draft_inputs(token_ids, positions, block_tables: np.ndarray, num_drafts, num_seqs: int,
                 feature_index=()) -> DraftInputs:
    """Host inputs of n rows padded to num_seqs rows."""
    return DraftInputs(*(pad(x, num_seqs) for x in (token_ids, positions, block_tables, num_drafts)),
                       np.array([len(token_ids)], np.int32), pad(feature_index, num_seqs, fill=-1))


def cache_slots(block_tables, rows, positions, block_size: int):
    """The cache slot of each (row, position) pair; a position past the table's width takes its last column (a
    padding row's: its write goes to the null block anyway)."""
    columns = jnp.minimum(positions // block_size, block_tables.shape[1] - 1)
    return block_tables[rows, columns] * block_size + positions % block_size


def write_draft_kv(draft, draft_cache, token_ids, positions, paged: PagedAttention):
    """The draft's KV of a model step's tokens (the same batch, slots and block tables): its cache layers."""
    _, draft_cache = draft(token_ids, positions, draft_cache, paged)
    return draft_cache


def drafting_steps(inp: DraftInputs, num_drafts: int, block_size: int, kernels: AttentionKernels, mesh, *,
                   offset: int = 0, first_writes=True):
    """Per draft step j of a drafting graph: (positions, PagedAttention) of its rows, one query each, at each row's
    position + offset + j. A row past its own num_drafts repeats its last step with its write sent to the null
    block (so it reads and writes only blocks the scheduler allocated to it), as is step 0 where first_writes is
    False. Unrolled by the caller: a GPU while loop syncs with the host at every iteration."""
    rows = len(inp.token_ids)
    real = jnp.arange(rows) < inp.num_seqs[0]
    cu_q_lens = jnp.minimum(jnp.arange(rows + 1), inp.num_seqs[0]).astype(jnp.int32)
    for j in range(num_drafts):
        positions = inp.positions + offset + jnp.minimum(j, jnp.maximum(inp.num_drafts - 1, 0))
        writes = (j < inp.num_drafts) & ((j > 0) | first_writes)
        slots = jnp.where(writes, cache_slots(inp.block_tables, jnp.arange(rows), positions, block_size), 0)
        batch = AttentionBatch(slots, cu_q_lens, jnp.where(real, positions + 1, 0), inp.block_tables, inp.num_seqs,
                               decode_only=kernels.has_decode_kernel)
        yield positions, PagedAttention(batch, kernels, mesh)


def draft_tokens(draft, draft_cache, inp: DraftInputs, *, num_drafts: int, **kw) -> tuple[list, jax.Array]:
    """num_drafts greedy decode steps of the draft model over a batch, in one graph: (its cache layers, drafts
    [S, num_drafts]). Step j computes each row's token at position + j (its last token, then its drafts) and writes
    its KV."""
    token_ids, drafts = inp.token_ids, []
    for positions, paged in drafting_steps(inp, num_drafts, **kw):
        hidden, draft_cache = draft(token_ids, positions, draft_cache, paged)
        token_ids = jnp.argmax(draft.logits(hidden), axis=-1).astype(jnp.int32)
        drafts.append(token_ids)
    return draft_cache, jnp.stack(drafts, axis=1)


def write_eagle_kv(head, head_cache, token_ids, positions, aux: list, features, feature_index,
                   attn: AttentionBatch, *, block_size: int, kernels: AttentionKernels, mesh):
    """An EAGLE-3 head's entries of a model step (module docstring): entry q - 1 of each token q, from q's token
    and the features at q - 1 (the step's own, or for a row's first token the previous step's). Returns (its cache
    layer, the features of every token [T, H]). A row's first entry, when its features are nowhere, is not written
    (a hole: its sequence drafts worse, verification stays exact)."""
    step_features = head.features(aux)
    tokens, rows = len(token_ids), len(attn.kv_lens)
    tok = jnp.arange(tokens)
    row = jnp.minimum(jnp.searchsorted(attn.cu_q_lens[1:], tok, side="right"), rows - 1)
    first = tok == attn.cu_q_lens[row]
    before = jnp.where(first[:, None], features[jnp.maximum(feature_index, 0)][row].astype(step_features.dtype),
                       jnp.roll(step_features, 1, axis=0))
    known = ~first | (feature_index[row] >= 0) & (positions > 0)
    prev = jnp.maximum(positions - 1, 0)
    slots = jnp.where(known & (tok < attn.cu_q_lens[attn.num_seqs[0]]),
                      jnp.where(first, cache_slots(attn.block_tables, row, prev, block_size),
                                jnp.roll(attn.slot_mapping, 1)), 0)
    batch = AttentionBatch(slots, attn.cu_q_lens, jnp.maximum(attn.kv_lens - 1, 0), attn.block_tables, attn.num_seqs,
                           decode_only=attn.decode_only)
    _, layer = head(token_ids, before, prev, layer_of(head_cache, 0), PagedAttention(batch, kernels, mesh))
    return with_layer(head_cache, 0, layer), step_features


def eagle_draft_tokens(head, head_cache, features, inp: DraftInputs, *, num_drafts: int, **kw
                       ) -> tuple[jax.Array, jax.Array]:
    """num_drafts greedy steps of an EAGLE-3 head over a batch, in one graph: (its cache layer, drafts
    [S, num_drafts]). Step 0 writes each row's entry before its last token (its last token, the features before
    it; not where those are nowhere), step j the entry of its (j - 1)-th draft with the head's output as
    features."""
    hidden = features[jnp.maximum(inp.feature_index, 0)].astype(head.fc.kernel.dtype)
    token_ids, drafts = inp.token_ids, []
    for positions, paged in drafting_steps(inp, num_drafts, offset=-1, first_writes=inp.feature_index >= 0, **kw):
        hidden, layer = head(token_ids, hidden, positions, layer_of(head_cache, 0), paged)
        head_cache = with_layer(head_cache, 0, layer)
        token_ids = head.propose(hidden)
        drafts.append(token_ids)
    return head_cache, jnp.stack(drafts, axis=1)
