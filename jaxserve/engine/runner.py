"""The model runner: device state (weights, paged KV cache, penalty state), bucketed static-shape inputs built
incrementally on the host, and one jitted step per bucket — embed -> layers (scatter KV writes + ragged paged
attention) -> logits of each sequence's last token -> sampling — with the cache and penalty state donated."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

import custom_calls

from jaxserve.cache.block_table import BlockTable
from jaxserve.cache.kv_cache import (allocate_kv_cache, copy_blocks, describe_kv_capacity, kv_bytes_per_block,
                                     num_blocks_for_memory)
from jaxserve.config import EngineConfig
from jaxserve.engine.sampler import (MODES, PenaltyState, SamplingTensors, init_penalty_state, mode_for,
                                     make_sampling_tensors, reset_slots, sample)
from jaxserve.engine.sampling_params import MAX_LOGPROBS
from jaxserve.engine.sequence import PENDING, Sequence
from jaxserve.models.attention import AttentionBatch
from jaxserve.models.loader import LoadedModel
from pallas_kernels.ragged_paged_attention import resolve_impl

MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8


def pow2_ladder(low: int, high: int) -> tuple[int, ...]:
    """Powers of two from low up to high, high itself always included."""
    ladder = [low << i for i in range(max(0, math.ceil(math.log2(high / low))) + 1) if low << i < high]
    return tuple(ladder + [high])


def bucket_for(n: int, ladder: tuple[int, ...]) -> int:
    return next(b for b in ladder if b >= n)


def decode_kernel_for(setting: str, head_dim: int) -> str:
    """The kernel of decode-only steps, a compiled variant of the step: "one_launch" (the Pallas decode-only
    launch), "cuda" (the custom call), or "ragged" (the mixed-batch path: where the Pallas kernels do not run,
    the attention is the pure-JAX reference either way). "auto" takes the Pallas launch: on the H100 it beat the
    CUDA call at every batch and context measured (benchmarks/NOTES_attention.md, v6); "cuda" forces the call,
    an error naming why when it cannot run."""
    if setting not in ("auto", "cuda"):
        raise ValueError(f"decode_attention must be auto or cuda, got {setting!r}")
    if setting == "cuda":
        why = (f"head_dim {head_dim} not in {custom_calls.HEAD_DIMS}" if head_dim not in custom_calls.HEAD_DIMS
               else custom_calls.unavailable_reason())
        if why:
            raise ValueError(f"decode_attention='cuda' but the CUDA custom calls are unavailable: {why}")
        return "cuda"
    return "one_launch" if resolve_impl("auto", interpret=False) == "pallas" else "ragged"


@jax.tree_util.register_dataclass
@dataclass(slots=True)
class StepInputs:
    token_ids: jax.Array       # [T]
    positions: jax.Array       # [T]
    attn: AttentionBatch
    logits_indices: jax.Array  # [S] flat index of each row's last token
    slot_ids: jax.Array        # [S] persistent slot of each row (padding: scratch slot)
    sample_mask: jax.Array     # [S]
    sampling: SamplingTensors
    prev_index: jax.Array      # [T] row of the previous step whose sampled token this input is; -1: token_ids has it
    next_prompt_ids: jax.Array  # [T] the prompt token after each input token (prompt logprobs); -1: none


@jax.tree_util.register_dataclass
@dataclass(slots=True)
class PromptLogprobs:
    """Per input token: logprob of the next prompt token and the top-K, from all-position logits."""
    logprob: jax.Array   # [T]
    top_ids: jax.Array   # [T, K]
    top_logprobs: jax.Array


@dataclass(slots=True)
class StepRow:
    seq: Sequence
    start: int      # first position computed this step
    count: int      # tokens computed this step (0 for a fork sampled from its parent's logits)
    logits_from: int = -1   # row whose last token's logits this row samples (forks); -1: its own

    @property
    def samples(self) -> bool:
        """This step reaches the end of the sequence's known tokens, so it samples the next one."""
        return self.start + self.count >= self.seq.num_tokens


def prompt_logprob_of(model, hidden, inp: StepInputs) -> PromptLogprobs:
    """All-position logits ([T, V]: only compiled into steps that serve a prompt_logprobs request)."""
    logprobs = jax.nn.log_softmax(model.logits(hidden), axis=-1)
    target = jnp.take_along_axis(logprobs, jnp.maximum(inp.next_prompt_ids, 0)[:, None], axis=-1)[:, 0]
    top, ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return PromptLogprobs(target, ids.astype(jnp.int32), top)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig):
        self.cfg, self.model_config = cfg, loaded.config
        self.graphdef, self.params = nnx.split(loaded.model)
        mc, dtype = loaded.config, loaded.model.embed_tokens.embedding[...].dtype
        self.token_buckets = cfg.token_buckets or pow2_ladder(MIN_TOKEN_BUCKET, cfg.max_num_batched_tokens)
        self.seq_buckets = cfg.seq_buckets or pow2_ladder(min(MIN_SEQ_BUCKET, cfg.max_num_seqs), cfg.max_num_seqs)
        self.max_blocks_per_seq = -(-cfg.max_model_len // cfg.block_size)
        self.penalty = init_penalty_state(cfg.max_num_seqs, mc.vocab_size)
        self.block_table = BlockTable(cfg.max_num_seqs, self.max_blocks_per_seq, cfg.block_size,
                                      self.token_buckets[-1])
        tok_eos = getattr(loaded.tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(dict.fromkeys(mc.eos_token_ids + (() if tok_eos is None else (tok_eos,))))
        self.decode_kernel = decode_kernel_for(cfg.decode_attention, mc.head_dim)
        if cfg.prefill_attention not in ("triton", "mosaic"):
            raise ValueError(f"prefill_attention must be triton or mosaic, got {cfg.prefill_attention!r}")
        if unknown := set(cfg.precompile_sampler_modes) - set(MODES):
            raise ValueError(f"precompile_sampler_modes: unknown {sorted(unknown)}; known: {list(MODES)}")
        self._step = jax.jit(self._step_fn, donate_argnums=(1, 2),
                             static_argnames=("num_logprobs", "prompt_logprobs", "mode"))
        self.last_tokens = jnp.zeros(self.seq_buckets[-1], jnp.int32)   # the previous step's samples, on device
        self.compiled_buckets: set[tuple] = set()
        bytes_per_block = kv_bytes_per_block(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, dtype)
        self.num_blocks = cfg.num_blocks or num_blocks_for_memory(
            bytes_per_block, activation_peak_bytes=self.activation_bytes(dtype), fraction=cfg.memory_fraction)
        print(describe_kv_capacity(self.num_blocks, cfg.block_size, bytes_per_block), file=sys.stderr)
        self.kv_cache = allocate_kv_cache(mc.num_layers, self.num_blocks, cfg.block_size, mc.num_kv_heads,
                                          mc.head_dim, dtype)

    def activation_bytes(self, dtype) -> int:
        """XLA's temp memory for the largest bucket's step, compiled against a 2-block stand-in cache (temp
        memory does not depend on the cache's size): reserved before the KV cache takes what is left."""
        mc = self.model_config
        block = jax.ShapeDtypeStruct((2, self.cfg.block_size, mc.num_kv_heads, mc.head_dim), dtype)
        inp = self._dummy_inputs(self.token_buckets[-1], self.seq_buckets[-1])
        compiled = self._step.lower(self.params, [(block, block)] * mc.num_layers, self.penalty, self.last_tokens,
                                    inp, num_logprobs=MAX_LOGPROBS, mode="sort").compile()
        analysis = compiled.memory_analysis()
        peak = analysis.temp_size_in_bytes if analysis is not None else 0
        print(f"activation peak of the largest step: {peak / 2**20:.1f} MiB", file=sys.stderr)
        return peak

    def _step_fn(self, params, kv_cache, penalty: PenaltyState, last_tokens, inp: StepInputs, *, num_logprobs: int,
                 prompt_logprobs: bool = False, mode: str = "sort"):
        model = nnx.merge(self.graphdef, params)
        # Async scheduling: a decode's input may be the token the previous step sampled, still on the device.
        token_ids = jnp.where(inp.prev_index >= 0, last_tokens[jnp.maximum(inp.prev_index, 0)], inp.token_ids)
        hidden, kv_cache = model(token_ids, inp.positions, kv_cache, inp.attn)
        logits = model.logits(hidden[inp.logits_indices])
        out, penalty = sample(logits, inp.sampling, penalty, inp.slot_ids, inp.sample_mask,
                              num_logprobs=num_logprobs, mode=mode)
        last_tokens = jnp.zeros_like(last_tokens).at[:out.tokens.shape[0]].set(out.tokens)
        return kv_cache, penalty, (out, prompt_logprob_of(model, hidden, inp) if prompt_logprobs else None), last_tokens

    def precompile(self) -> None:
        """Compile every (tokens, seqs) bucket and sampler mode ahead of time; the persistent cache makes
        restarts fast. Logprob variants compile on first use."""
        shapes = [(t, s, "ragged") for t in self.token_buckets for s in self.seq_buckets]
        if self.decode_kernel != "ragged":
            shapes += [(bucket_for(s, self.token_buckets), s, self.decode_kernel) for s in self.seq_buckets]
        graphs = [(*shape, mode) for shape in shapes for mode in self.cfg.precompile_sampler_modes]
        for t, s, decode_impl, mode in tqdm(graphs, desc="compiling step graphs", unit="graph", file=sys.stderr,
                                            disable=None):
            self.run(self._dummy_inputs(t, s, decode_impl), 0, mode=mode)

    def _dummy_inputs(self, num_tokens: int, num_seqs: int, decode_impl: str = "ragged") -> StepInputs:
        z = lambda n: np.zeros(n, np.int32)  # noqa: E731 — all padding: writes land in the null block
        attn = AttentionBatch(z(num_tokens), z(num_seqs + 1), z(num_seqs),
                              np.zeros((num_seqs, self.max_blocks_per_seq), np.int32), z(1), decode_impl,
                              self.cfg.prefill_attention)
        sampling = make_sampling_tensors([], [], [], num_rows=num_seqs)
        return StepInputs(z(num_tokens), z(num_tokens), attn, z(num_seqs),
                          np.full(num_seqs, self.cfg.max_num_seqs, np.int32), np.zeros(num_seqs, bool), sampling,
                          np.full(num_tokens, -1, np.int32), np.full(num_tokens, -1, np.int32))

    def run(self, inp: StepInputs, num_logprobs: int = 0, prompt_logprobs: bool = False, mode: str = "sort"):
        """One jitted step on ready inputs: (SamplerOutput, PromptLogprobs | None) as device arrays, no sync."""
        self.compiled_buckets.add((len(inp.token_ids), len(inp.slot_ids), inp.attn.decode_impl, num_logprobs,
                                   prompt_logprobs, mode))
        self.kv_cache, self.penalty, out, self.last_tokens = self._step(
            self.params, self.kv_cache, self.penalty, self.last_tokens, inp, num_logprobs=num_logprobs,
            prompt_logprobs=prompt_logprobs, mode=mode)
        return out

    def update_block_table(self, updates, slot_of) -> None:
        for seq_id, start, ids in updates:
            self.block_table.write(slot_of(seq_id), start, ids)

    def clear_slot(self, slot: int) -> None:
        self.block_table.clear_row(slot)

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        if len(src):
            self.kv_cache = copy_blocks(self.kv_cache, src, dst)

    def reset_slots(self, seqs: list[Sequence]) -> None:
        """Fresh penalty state for newly placed sequences (prompt mask; counts of tokens already generated)."""
        if not seqs:
            return
        width = 1 << max(1, max(s.num_tokens for s in seqs) - 1).bit_length()
        prompt, output = np.full((2, len(seqs), width), -1, np.int32)
        for i, s in enumerate(seqs):
            prompt[i, :s.num_prompt_tokens] = s.token_ids[:s.num_prompt_tokens]
            output[i, :s.num_output_tokens] = s.output_token_ids
        self.penalty = reset_slots(self.penalty, np.array([s.slot for s in seqs], np.int32), prompt, output)

    def launch(self, rows: list[StepRow]):
        """Dispatch one step over rows (decodes first); returns device arrays at once (no sync)."""
        want = max((r.seq.params.logprobs or 0) for r in rows)
        prompt = any(r.seq.params.prompt_logprobs is not None and r.start < r.seq.num_prompt_tokens for r in rows)
        mode = mode_for([r.seq.params for r in rows if r.samples], self.model_config.vocab_size)
        return self.run(self.prepare_inputs(rows), MAX_LOGPROBS if want else 0, prompt, mode)

    def prepare_inputs(self, rows: list[StepRow]) -> StepInputs:
        counts = np.array([r.count for r in rows], np.int32)
        starts = np.array([r.start for r in rows], np.int32)
        slots = np.array([r.seq.slot for r in rows], np.int32)
        n_tok, n_rows = int(counts.sum()), len(rows)
        t_pad, s_pad = bucket_for(max(n_tok, 1), self.token_buckets), bucket_for(n_rows, self.seq_buckets)
        cu = np.zeros(s_pad + 1, np.int32)
        np.cumsum(counts, out=cu[1:n_rows + 1])
        cu[n_rows + 1:] = cu[n_rows]
        token_ids, positions = np.zeros(t_pad, np.int32), np.zeros(t_pad, np.int32)
        token_ids[:n_tok] = [t for r in rows for t in r.seq.token_ids[r.start:r.start + r.count]]
        prev_index = np.full(t_pad, -1, np.int32)
        for i in np.flatnonzero(token_ids[:n_tok] == PENDING):   # only a row's last token can still be pending
            prev_index[i] = rows[np.searchsorted(cu[1:n_rows + 1], i, side="right")].seq.pending_row
        token_ids[prev_index >= 0] = 0
        next_prompt_ids = np.full(t_pad, -1, np.int32)
        for r, lo in zip(rows, cu[:n_rows]):
            if r.seq.params.prompt_logprobs is not None and r.start < r.seq.num_prompt_tokens:
                nxt = r.seq.token_ids[r.start + 1:min(r.start + r.count + 1, r.seq.num_prompt_tokens)]
                next_prompt_ids[lo:lo + len(nxt)] = nxt
        positions[:n_tok] = np.arange(n_tok) - np.repeat(cu[:n_rows] - starts, counts)
        slot_mapping = self.block_table.compute_slot_mapping(np.repeat(slots, counts), positions[:n_tok], t_pad)
        kv_lens = np.zeros(s_pad, np.int32)
        kv_lens[:n_rows] = starts + counts
        padded_slots = np.full(s_pad, self.cfg.max_num_seqs, np.int32)
        padded_slots[:n_rows] = slots
        logits_idx = np.zeros(s_pad, np.int32)
        own_last = np.maximum(cu[1:n_rows + 1] - 1, 0)
        from_row = np.array([i if r.logits_from < 0 else r.logits_from for i, r in enumerate(rows)], np.int32)
        logits_idx[:n_rows] = own_last[from_row]
        mask = np.zeros(s_pad, bool)
        mask[:n_rows] = [r.samples for r in rows]
        decode_only = n_tok == n_rows and all(r.count == 1 for r in rows)
        decode_impl = self.decode_kernel if decode_only else "ragged"
        attn = AttentionBatch(slot_mapping.copy(), cu, kv_lens,
                              self.block_table.table[padded_slots % self.cfg.max_num_seqs],
                              np.array([n_rows], np.int32), decode_impl, self.cfg.prefill_attention)
        sampling = make_sampling_tensors([r.seq.params for r in rows], [r.seq.seed for r in rows],
                                         [r.seq.num_output_tokens for r in rows], num_rows=s_pad,
                                         eos_token_ids=self.eos_token_ids)
        return StepInputs(token_ids, positions, attn, logits_idx, padded_slots, mask, sampling, prev_index,
                          next_prompt_ids)
