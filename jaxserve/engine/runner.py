"""The model runner: device state (weights, paged KV cache, penalty state), the device slots of the running
sequences, bucketed static-shape inputs, and one jitted step per bucket — embed -> layers (scatter KV writes +
ragged paged attention) -> logits of each sequence's last token -> sampling — with the cache and penalty state
donated. `execute` consumes one `SchedulerOutput`."""
from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxserve.cache.block_table import BlockTable
from jaxserve.cache.kv_cache import (allocate_kv_cache, copy_blocks, describe_kv_capacity, kv_bytes_per_block,
                                     num_blocks_for_memory)
from jaxserve.config import EngineConfig
from jaxserve.engine.sampler import PenaltyState, init_penalty_state, mode_for, reset_slots, sample
from jaxserve.engine.sampling_params import MAX_LOGPROBS
from jaxserve.engine.scheduler import SchedulerOutput, StepRow
from jaxserve.engine.sequence import PENDING, Sequence
from jaxserve.engine.step_inputs import StepInputs, build_step_inputs
from jaxserve.models.attention import AttentionKernels, PagedAttention, resolve_attention_kernels
from jaxserve.models.loader import LoadedModel

MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8


def pow2_ladder(low: int, high: int) -> tuple[int, ...]:
    """Powers of two from low up to high, high itself always included."""
    ladder = [low << i for i in range(max(0, math.ceil(math.log2(high / low))) + 1) if low << i < high]
    return tuple(ladder + [high])


def bucket_for(n: int, ladder: tuple[int, ...]) -> int:
    return next(b for b in ladder if b >= n)


def bucket_ladders(cfg: EngineConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (token, seq) bucket ladders of an engine config."""
    return (cfg.token_buckets or pow2_ladder(MIN_TOKEN_BUCKET, cfg.max_num_batched_tokens),
            cfg.seq_buckets or pow2_ladder(min(MIN_SEQ_BUCKET, cfg.max_num_seqs), cfg.max_num_seqs))


@jax.tree_util.register_dataclass
@dataclass(slots=True)
class PromptLogprobs:
    """Per input token: logprob of the next prompt token and the top-K, from all-position logits."""
    logprob: jax.Array   # [T]
    top_ids: jax.Array   # [T, K]
    top_logprobs: jax.Array


def run_step(params, kv_cache, penalty: PenaltyState, last_tokens, inp: StepInputs, *, graphdef,
             kernels: AttentionKernels):
    """The jitted step: (kv_cache, penalty, (SamplerOutput, PromptLogprobs | None), last_tokens)."""
    model = nnx.merge(graphdef, params)
    # Async scheduling: a decode's input may be the token the previous step sampled, still on the device.
    token_ids = jnp.where(inp.prev_index >= 0, last_tokens[jnp.maximum(inp.prev_index, 0)], inp.token_ids)
    hidden, kv_cache = model(token_ids, inp.positions, kv_cache, PagedAttention(inp.attn, kernels))
    logits = model.logits(hidden[inp.logits_indices])
    out, penalty = sample(logits, inp.sampling, penalty, inp.slot_ids, inp.sample_mask,
                          num_logprobs=inp.num_logprobs, mode=inp.sampler_mode)
    last_tokens = jnp.zeros_like(last_tokens).at[:out.tokens.shape[0]].set(out.tokens)
    prompt_lp = prompt_logprobs_of(model, hidden, inp) if inp.prompt_logprobs else None
    return kv_cache, penalty, (out, prompt_lp), last_tokens


def prompt_logprobs_of(model, hidden, inp: StepInputs) -> PromptLogprobs:
    """All-position logits ([T, V]: only compiled into steps that serve a prompt_logprobs request)."""
    logprobs = jax.nn.log_softmax(model.logits(hidden), axis=-1)
    target = jnp.take_along_axis(logprobs, jnp.maximum(inp.next_prompt_ids, 0)[:, None], axis=-1)[:, 0]
    top, ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return PromptLogprobs(target, ids.astype(jnp.int32), top)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig):
        self.cfg, self.model_config = cfg, loaded.config
        graphdef, self.params = nnx.split(loaded.model)
        mc, dtype = loaded.config, loaded.model.embed_tokens.embedding[...].dtype
        self.token_buckets, self.seq_buckets = bucket_ladders(cfg)
        self.max_blocks_per_seq = -(-cfg.max_model_len // cfg.block_size)
        self.penalty = init_penalty_state(cfg.max_num_seqs, mc.vocab_size)
        self.block_table = BlockTable(cfg.max_num_seqs, self.max_blocks_per_seq)
        self.free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        self.slot_of: dict[int, int] = {}     # seq_id -> device slot: block-table row and penalty state
        self.prev_rows: dict[int, int] = {}   # seq_id -> row of the last launched step that samples it
        self.eos_token_ids = loaded.eos_token_ids
        self.kernels = resolve_attention_kernels(cfg.decode_attention, cfg.prefill_attention, mc.head_dim)
        self._step = jax.jit(functools.partial(run_step, graphdef=graphdef, kernels=self.kernels),
                             donate_argnums=(1, 2))
        self.last_tokens = jnp.zeros(self.seq_buckets[-1], jnp.int32)   # the previous step's samples, on device
        self.compiled_variants: set[tuple] = set()
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
        inp = self.step_inputs(num_tokens=self.token_buckets[-1], num_seqs=self.seq_buckets[-1],
                               num_logprobs=MAX_LOGPROBS, sampler_mode="sort")
        compiled = self._step.lower(self.params, [(block, block)] * mc.num_layers, self.penalty, self.last_tokens,
                                    inp).compile()
        analysis = compiled.memory_analysis()
        peak = analysis.temp_size_in_bytes if analysis is not None else 0
        print(f"activation peak of the largest step: {peak / 2**20:.1f} MiB", file=sys.stderr)
        return peak

    def precompile(self) -> None:
        """Compile every (tokens, seqs) bucket and sampler mode ahead of time, and the decode-only graph of
        each seq bucket; the persistent cache makes restarts fast. Logprob variants compile on first use."""
        shapes = [(t, s, False) for t in self.token_buckets for s in self.seq_buckets]
        if self.kernels.has_decode_kernel:
            shapes += [(bucket_for(s, self.token_buckets), s, True) for s in self.seq_buckets]
        graphs = [(*shape, mode) for shape in shapes for mode in self.cfg.precompile_sampler_modes]
        for t, s, decode_only, mode in tqdm(graphs, desc="compiling step graphs", unit="graph", file=sys.stderr,
                                            disable=None):
            self.run(self.step_inputs(num_tokens=t, num_seqs=s, decode_only=decode_only, sampler_mode=mode))

    def step_inputs(self, **kw) -> StepInputs:
        """build_step_inputs with this engine's constants. Steps whose rows all decode one token run the decode
        kernel's graph where there is one (`decode_only` forces it, for the compile-time dummies)."""
        counts = kw.get("counts", ())
        decode_only = kw.pop("decode_only", len(counts) > 0 and all(c == 1 for c in counts))
        kw.setdefault("block_tables", np.zeros((0, self.max_blocks_per_seq), np.int32))
        return build_step_inputs(block_size=self.cfg.block_size, scratch_slot=self.cfg.max_num_seqs,
                                 eos_token_ids=self.eos_token_ids,
                                 decode_only=decode_only and self.kernels.has_decode_kernel, **kw)

    def run(self, inp: StepInputs):
        """One jitted step on ready inputs: (SamplerOutput, PromptLogprobs | None) as device arrays, no sync."""
        self.compiled_variants.add(inp.variant)
        self.kv_cache, self.penalty, out, self.last_tokens = self._step(
            self.params, self.kv_cache, self.penalty, self.last_tokens, inp)
        return out

    def execute(self, out: SchedulerOutput):
        """Apply the step's slot, block-table and cache changes and launch it: device outputs (None without
        rows), no sync."""
        for seq_id in out.preempted + out.finished:
            self._release(seq_id)
        for seq in out.placed:
            self.slot_of[seq.seq_id] = self.free_slots.pop()
        for seq_id, start, block_ids in out.block_updates:
            self.block_table.write(self.slot_of[seq_id], start, block_ids)
        if len(out.copies[0]):
            self.kv_cache = copy_blocks(self.kv_cache, *out.copies)
        self._reset_penalties(out.placed)
        if not out.rows:
            return None
        inp = self.prepare_inputs(out.rows)
        self.prev_rows = {row.seq.seq_id: i for i, row in enumerate(out.rows) if row.samples}
        return self.run(inp)

    def _release(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)   # None: finished before it was ever placed
        if slot is not None:
            self.block_table.clear_row(slot)
            self.free_slots.append(slot)

    def _reset_penalties(self, seqs: list[Sequence]) -> None:
        """Fresh penalty state for newly placed sequences (prompt mask; counts of tokens already generated)."""
        if not seqs:
            return
        outputs = [s.confirmed_output_ids for s in seqs]
        width = 1 << max(1, max(s.num_prompt_tokens + len(o) for s, o in zip(seqs, outputs)) - 1).bit_length()
        prompt, output = np.full((2, len(seqs), width), -1, np.int32)
        for i, (s, o) in enumerate(zip(seqs, outputs)):
            prompt[i, :s.num_prompt_tokens] = s.token_ids[:s.num_prompt_tokens]
            output[i, :len(o)] = o
        slots = np.array([self.slot_of[s.seq_id] for s in seqs], np.int32)
        self.penalty = reset_slots(self.penalty, slots, prompt, output)

    def prepare_inputs(self, rows: list[StepRow]) -> StepInputs:
        counts = [r.count for r in rows]
        token_ids = np.array([t for r in rows for t in r.seq.token_ids[r.start:r.start + r.count]], np.int32)
        slots = np.array([self.slot_of[r.seq.seq_id] for r in rows], np.int32)
        prompt = any(r.seq.params.prompt_logprobs is not None and r.start < r.seq.num_prompt_tokens for r in rows)
        return self.step_inputs(
            num_tokens=bucket_for(max(len(token_ids), 1), self.token_buckets),
            num_seqs=bucket_for(len(rows), self.seq_buckets), block_tables=self.block_table.table[slots],
            starts=[r.start for r in rows], counts=counts, token_ids=np.where(token_ids == PENDING, 0, token_ids),
            slots=slots, sample_mask=[r.samples for r in rows], params=[r.seq.params for r in rows],
            seeds=[r.seq.seed for r in rows], num_generated=[r.num_generated for r in rows],
            logits_from=[r.logits_from for r in rows], prev_index=self._prev_index(rows, counts, token_ids),
            next_prompt_ids=next_prompt_ids(rows, len(token_ids)) if prompt else None,
            num_logprobs=MAX_LOGPROBS if any(r.seq.params.logprobs for r in rows) else 0, prompt_logprobs=prompt,
            sampler_mode=mode_for([r.seq.params for r in rows if r.samples], self.model_config.vocab_size))

    def _prev_index(self, rows: list[StepRow], counts: list[int], token_ids: np.ndarray) -> np.ndarray:
        """Per input token, the row of the previous step that sampled it while it is still on the device."""
        prev_index = np.full(len(token_ids), -1, np.int32)
        pending = np.flatnonzero(token_ids == PENDING)   # only a row's last token can still be pending
        owners = np.searchsorted(np.cumsum(counts), pending, side="right")
        prev_index[pending] = [self.prev_rows[rows[i].seq.seq_id] for i in owners]
        return prev_index


def next_prompt_ids(rows: list[StepRow], num_tokens: int) -> np.ndarray:
    """Per input token, the prompt token after it (prompt logprobs); -1 past the prompt and for other rows."""
    ids, lo = np.full(num_tokens, -1, np.int32), 0
    for r in rows:
        if r.seq.params.prompt_logprobs is not None and r.start < r.seq.num_prompt_tokens:
            nxt = r.seq.token_ids[r.start + 1:min(r.start + r.count + 1, r.seq.num_prompt_tokens)]
            ids[lo:lo + len(nxt)] = nxt
        lo += r.count
    return ids
