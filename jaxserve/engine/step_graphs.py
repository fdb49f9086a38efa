"""The compiled graphs of a step, by key: the model (embed -> layers with scatter KV writes + ragged paged
attention -> logits of each row's token) per (token bucket, seq bucket, decode-only, W), the sampler per (seq
bucket, mode, logprobs, constrained, W) (W > 1: speculative steps, which sample each row at W positions),
all-position prompt logprobs per token bucket, penalty resets and block copies per padded size. The cache and the
penalty state are donated: updated in place.

One function maps a step's size to its buckets (`step_shape`); the graphs compiled before serving are that function
over every size a step can have (`graph_keys`), so a step never meets a graph that was not compiled. A graph is
made from its key alone (`lower`). Graphs that take the cache carry its size in their key."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import custom_calls
from custom_calls import vmm
from jaxserve.cache.kv_backend import KVBackend
from jaxserve.cache.kv_cache import KVCache, copy_blocks, copy_bucket
from jaxserve.config import SAMPLER_MODES, EngineConfig, graph_knobs
from jaxserve.engine.compilation import CompilationManager, ExecutableCache, fingerprint
from jaxserve.engine.drafter import (DraftInputs, draft_inputs, draft_tokens, eagle_draft_tokens, write_draft_kv,
                                     write_eagle_kv)
from jaxserve.engine.sampler import (PenaltyState, SamplerOutput, init_penalty_state, reset_slots, sample,
                                     sampler_modes, verify)
from jaxserve.engine.sampling_params import MAX_LOGPROBS
from jaxserve.engine.step_inputs import (Layout, ModelInputs, SamplerInputs, StepInputs, build_step_inputs, pack,
                                         share_prefixes)
from jaxserve.models.attention import AttentionKernels, PagedAttention, resolve_attention_kernels
from jaxserve.models import fp8, llama
from jaxserve.models.fp8 import W8A16_MAX_ROWS
from jaxserve.models.loader import LoadedModel
from jaxserve.sharding import traced_on
from pallas_kernels.ragged_paged_attention import resolve_impl, triton_in_auto

MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8
MIN_RESET_WIDTH = 64   # penalty resets pad prompt + output tokens to a power of four from here (few graphs)
PROMPT_LOGPROBS_ROWS = 256   # prompt logprobs take [rows, V] logits at a time, not [T, V] (5 GB at 4K x 128K)
# GPU graphs of more rows than this take cuBLAS GEMMs, not XLA's autotuned Triton ones: cuBLAS starts faster and
# runs big steps as fast or faster, but small GEMMs (batch-1 decode) are faster with Triton.
TRITON_GEMM_MAX_ROWS = 64   # bf16 weights; FP8 ones: see compiler_options
# Cascade attention ("auto") takes the groups of a decode-only step that hold CASCADE_MIN_MEMBERS rows or more, and
# runs when they save CASCADE_MIN_SAVED_KEYS key reads (shared tokens x (members - 1), summed). Plain decode reads a
# small group's prefix from L2 after its first member (the engine lays n > 1 samples side by side), so a shared
# pass pays only for large groups. H100 (benchmarks/cascade.py, offline.py): one group of 256 x 1,024 shared keys
# 2.1x at kernel level, 1.11x engine throughput; 128 x 1,024 1.29x; 64 x 1,024 0.92x; 32 members never paid;
# n = 8 over 32 prompts of 1,024 lost in the engine (0.965x), though 1.7x against shuffled rows at kernel level.
CASCADE_MIN_MEMBERS = 128
CASCADE_MIN_SAVED_KEYS = 65536
# Plain decode on the Mosaic GPU kernel gains less from a shared prefix than the Triton kernel does (H200,
# cascade.py --mosaic: 32 groups of 8 side by side, 1,024 shared: plain 261 us against Triton's 159, cascade 120),
# so over it groups of 8 pay; one group of 64 x 1,024 (saving 64,512 keys) tied and 8 x 1,024 lost (50 against
# 12 us): the saved keys' bound keeps both out.
CASCADE_MOSAIC_MIN_MEMBERS = 8
CASCADE_MAX_GROUPS = 64   # groups a step's shared pass takes (the most saving ones): n = 8 over 32 prompts fits


class GraphKey(NamedTuple):
    """A compiled graph: its kind, its static sizes and, for a graph that takes the cache, the cache's blocks."""
    kind: str
    dims: tuple = ()
    num_blocks: int | None = None


PEAK = GraphKey("peak", ("model",))   # the largest model graph on a stand-in cache: its memory analysis only


def pow2_ladder(low: int, high: int, factor: int = 2) -> tuple[int, ...]:
    """low, low * factor, ... (powers of two for factor 2, 4, ...) below high, then high itself."""
    ladder = [low * factor ** i for i in range(max(0, math.ceil(math.log(high / low, factor))) + 1)]
    return tuple([x for x in ladder if x < high] + [high])


def bucket_for(n: int, ladder: tuple[int, ...]) -> int:
    return next(b for b in ladder if b >= n)


def bucket_ladders(cfg: EngineConfig, cpu: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (token, seq) bucket ladders of an engine config. On a CPU the default seq ladder starts with one row: a
    CPU multiplies every padded row by the weights, so one stream would decode MIN_SEQ_BUCKET rows."""
    seqs = pow2_ladder(min(MIN_SEQ_BUCKET, cfg.max_num_seqs), cfg.max_num_seqs)
    return (cfg.token_buckets or pow2_ladder(MIN_TOKEN_BUCKET, cfg.max_num_batched_tokens),
            cfg.seq_buckets or (1,) * (cpu and seqs[0] > 1) + seqs)


def step_shape(num_tokens: int, num_rows: int, decode_only: bool, ladders: tuple, has_decode_kernel: bool,
               width: int = 1) -> tuple[int, int, bool]:
    """The (token bucket, seq bucket, decode-only) a step pads to: a row without tokens (an n > 1 child) still
    takes a token's place; decode-only (one token per row) pads its tokens to the seq bucket where that is
    smaller, and runs the decode kernel's graph where there is one. A speculative step (rows sampling at `width`
    positions) pads to seq bucket x width where that holds its tokens and is smaller: a CPU multiplies every
    padded token by the weights."""
    tokens, seqs = bucket_for(max(num_tokens, num_rows, 1), ladders[0]), bucket_for(num_rows, ladders[1])
    if decode_only:
        return min(tokens, seqs), seqs, has_decode_kernel
    return (min(tokens, seqs * width) if width > 1 and num_tokens <= seqs * width else tokens), seqs, False


def step_sizes(cfg: EngineConfig, ladders: tuple, width: int = 1) -> Iterator[tuple[int, int, bool]]:
    """(tokens, rows, decode-only) sizes that reach every shape a step can take (speculative steps: of `width`):
    step_shape is constant between consecutive bucket bounds, so each bound and the size after it stand for all
    sizes."""
    edges = (*ladders[0], *ladders[1], *(s * width for s in ladders[1] if width > 1))
    bounds = sorted({1, *(b + d for b in edges for d in (0, 1))})
    for rows in (r for r in bounds if r <= cfg.max_num_seqs):
        if width == 1:
            yield rows, rows, True   # every row decodes one token
        yield from ((n, rows, False) for n in bounds if n <= cfg.max_num_batched_tokens)


@jax.tree_util.register_dataclass
@dataclass(slots=True)
class PromptLogprobs:
    """Per input token: logprob of the next prompt token and the top-K, from all-position logits."""
    logprob: jax.Array   # [T]
    top_ids: jax.Array   # [T, K]
    top_logprobs: jax.Array


class ModelDef(NamedTuple):
    """A model's static definition (nnx graphdef, its state's treedef), its weights params[start:stop] of the
    graphs' flat list (a draft model's follow the model's) and its layers kv_cache[first_layer:] of the cache."""
    graphdef: nnx.GraphDef
    state_def: jax.tree_util.PyTreeDef
    start: int
    stop: int
    first_layer: int = 0

    def merge(self, params: list):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.state_def, params[self.start:self.stop]))


def run_model(params, kv_cache, last_tokens, inp: ModelInputs, features=None, outputs=None, *, model_def: ModelDef,
              kernels: AttentionKernels, mesh: Mesh, fence: bool = False, draft_def: ModelDef | None = None,
              block_size: int = 0):
    """The model graph: (kv_cache, f32 logits [S, V] of each row's token, hidden states [T, H], features); with a
    draft model, the draft's KV of the same tokens written too; with an EAGLE-3 head (features given: the previous
    step's), the head's entries and the features of this step's logits positions (engine/drafter.py). outputs: the
    (logits, hidden) buffers of the graph's previous run, donated: the new ones are written over them."""
    model = model_def.merge(params)
    draft = None if draft_def is None else draft_def.merge(params)
    # Async scheduling: a decode's input may be the token the previous step sampled, still on the device.
    token_ids = jnp.where(inp.prev_index >= 0, last_tokens[jnp.maximum(inp.prev_index, 0)], inp.token_ids)
    paged = PagedAttention(inp.attn, kernels, mesh)
    aux_layers = () if features is None else draft.aux_layers
    hidden, kv_cache, aux = model.forward(token_ids, inp.positions, kv_cache, paged, aux_layers)
    if draft is not None:
        split = draft_def.first_layer
        if features is None:
            kv_cache = kv_cache[:split] + write_draft_kv(draft, kv_cache[split:], token_ids, inp.positions, paged)
        else:
            head_cache, step_features = write_eagle_kv(
                draft, kv_cache[split:], token_ids, inp.positions, aux, features, inp.feature_index, inp.attn,
                block_size=block_size, kernels=kernels, mesh=mesh)
            kv_cache = kv_cache[:split] + head_cache
            kept = step_features[inp.logits_indices].astype(features.dtype)
            features = jnp.zeros_like(features).at[:len(kept)].set(kept)
    with traced_on(mesh):
        logits = model.logits(hidden[inp.logits_indices])
    if fence:   # vattention on GPU: the logits follow every cache read; unmaps wait for this fence
        logits = vmm.fence(logits)
    if outputs is not None:
        logits, hidden = overwrite(outputs, (logits, hidden))
    return kv_cache, logits, hidden, features


def overwrite(old, new):
    """new's values in old's (donated) buffers: a graph's buffers keep their device addresses from run to run, so
    a CUDA graph recorded over them is launched as it is, not re-recorded on every step (XLA re-records the whole
    step's command buffer when any buffer it uses moves: milliseconds of host time, with the device idle)."""
    return jax.tree.map(lambda o, n: jax.lax.dynamic_update_slice(o, n, (0,) * o.ndim), old, new)


def run_sent_model(params, kv_cache, last_tokens, model_bytes, features=None, outputs=None, layout: Layout = None,
                   **kw):
    """run_model over the model's inputs as they were sent, one byte buffer (step_inputs.pack). On a GPU the bytes
    are copied first, outside the graph's CUDA graph (custom_calls.copy_outside_graphs): the buffer is new at every
    step, and the graph recorded over the copy it reads is launched as it is."""
    return run_model(params, kv_cache, last_tokens, layout.unpack(custom_calls.copy_outside_graphs(model_bytes)),
                     features, outputs, **kw)


def model_args(inp: StepInputs, features, outputs) -> tuple:
    """A model graph's arguments after the cache and the last tokens, for inp's step (run_sent_model's)."""
    return pack(inp.model), features, outputs, Layout.of(inp.model)


def run_sampler(logits, penalty: PenaltyState, inp: SamplerInputs, last_tokens,
                outputs: SamplerOutput | None = None):
    """The sampler graph: (penalty, each row's last sample in last_tokens' donated buffer, zero-padded,
    SamplerOutput, written over outputs' buffers when given). A speculative step's (draft_ids given) verifies its
    rows' drafts: each row's last sample is the one after its accepted drafts."""
    if inp.draft_ids is None:
        out, penalty = sample(logits, inp.sampling, penalty, inp.slot_ids, inp.sample_mask,
                              num_logprobs=inp.num_logprobs, mode=inp.mode, token_bitmask=inp.token_bitmask)
        last = out.tokens
    else:
        out, penalty = verify(logits, inp.sampling, penalty, inp.slot_ids, inp.sample_mask, inp.draft_ids,
                              num_logprobs=inp.num_logprobs, mode=inp.mode)
        last = jnp.take_along_axis(out.tokens.reshape(len(inp.draft_ids), -1), out.num_accepted[:, None], axis=1)[:, 0]
    last_tokens = overwrite(last_tokens, jnp.zeros_like(last_tokens).at[:last.shape[0]].set(last))
    return penalty, last_tokens, out if outputs is None else overwrite(outputs, out)


def run_sent_sampler(logits, penalty: PenaltyState, sampler_bytes, token_bitmask, last_tokens,
                     outputs: SamplerOutput | None = None, layout: Layout = None):
    """run_sampler over the sampler's inputs unpacked from the bytes they were sent as (copied first, as the
    model's are: run_sent_model); a constrained step's token bitmask, made on the host after its model graph was
    launched, comes beside them."""
    inp = layout.unpack(custom_calls.copy_outside_graphs(sampler_bytes))
    if token_bitmask is not None:
        inp = dataclasses.replace(inp, token_bitmask=token_bitmask)
    return run_sampler(logits, penalty, inp, last_tokens, outputs)


def run_drafts(params, draft_cache, inp: DraftInputs, features=None, *, draft_def: ModelDef, **kw
               ) -> tuple[list, jax.Array]:
    """The drafting graph: (the draft's cache layers, drafts [S, k]) from the draft model (drafter.draft_tokens)
    or, features given, the EAGLE-3 head (drafter.eagle_draft_tokens)."""
    if features is None:
        return draft_tokens(draft_def.merge(params), draft_cache, inp, **kw)
    return eagle_draft_tokens(draft_def.merge(params), draft_cache, features, inp, **kw)


def run_prompt_logprobs(params, hidden, next_prompt_ids, *, model_def: ModelDef) -> PromptLogprobs:
    """All-position logprobs (run only for steps that serve a prompt_logprobs request), PROMPT_LOGPROBS_ROWS
    tokens at a time."""
    model, rows = model_def.merge(params), math.gcd(len(hidden), PROMPT_LOGPROBS_ROWS)

    def chunk(args):
        h, nxt = args
        logprobs = jax.nn.log_softmax(model.logits(h), axis=-1)
        target = jnp.take_along_axis(logprobs, jnp.maximum(nxt, 0)[:, None], axis=-1)[:, 0]
        top, ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
        return PromptLogprobs(target, ids.astype(jnp.int32), top)

    out = jax.lax.map(chunk, (hidden.reshape(-1, rows, hidden.shape[-1]), next_prompt_ids.reshape(-1, rows)))
    return jax.tree.map(lambda x: x.reshape(len(hidden), *x.shape[2:]), out)


def kv_addressing(cells: np.ndarray, blocks_per_row: int | None) -> dict:
    """Where rows' KV lies, as build_step_inputs takes it: their block-table rows or, under contiguous kernels,
    their cache rows (no block ids on the host)."""
    if blocks_per_row is None:
        return dict(block_tables=cells)
    return dict(kv_rows=cells, blocks_per_row=blocks_per_row)


class StepGraphs:
    """One engine's jitted step functions and their executables by GraphKey. Their shardings are explicit so that
    XLA never moves the weights or the cache: weights as loaded, the cache as its backend lays it out (donated),
    everything else replicated: the model's logits gathered from the vocab-split LM head for the sampler, which
    runs whole on every device. Graphs that take the cache exist once `bind_cache` gave its size."""

    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, mesh: Mesh, backend: KVBackend,
                 draft: LoadedModel | None = None):
        mc = self.model_config = loaded.config
        self.cfg, self.mesh, self.backend = cfg, mesh, backend
        graphdef, state = nnx.split(loaded.model)
        # the weights as a flat list: a call flattens it in C++, an nnx State by a Python callback per weight (~1 ms)
        self.params, state_def = jax.tree.flatten(state)
        model_def = ModelDef(graphdef, state_def, 0, len(self.params))
        self.draft_def = None if draft is None else self._add_draft(draft, mc.num_layers)
        self.speculative = cfg.speculative_config
        self.dtype, self.quantization = loaded.dtype, loaded.quantization
        self.eos_token_ids = loaded.eos_token_ids
        cpu = mesh.devices.flat[0].platform == "cpu"
        self.ladders = self.token_buckets, self.seq_buckets = bucket_ladders(cfg, cpu)
        # an EAGLE-3 head's features at the logits positions of the last step that ran it, from graph to graph
        self.features = None if self.speculative is None or self.speculative.method != "eagle3" else \
            jax.ShapeDtypeStruct((self.spec_seq_buckets[-1] * self.speculative.width, draft.config.hidden_size),
                                 loaded.dtype)
        self.reset_widths = pow2_ladder(MIN_RESET_WIDTH, cfg.max_model_len, factor=4)
        self.max_blocks_per_seq = -(-cfg.max_model_len // cfg.block_size)
        self.kernels = resolve_attention_kernels(cfg.decode_attention, cfg.prefill_attention, mc.head_dim,
                                                 backend.blocks_per_row, backend.dtype)
        self.cascade_rule = cascade_rule(cfg.cascade_attention, self.kernels, mc.sliding_window)
        self.replicated = NamedSharding(mesh, P())
        graphs_fingerprint = fingerprint(mc, graph_knobs(cfg), str(self.dtype), loaded.quantization, fp8.switches(),
                                         llama.BF16_DECODE_KERNEL,
                                         draft and (draft.config, draft.quantization),
                                         [(d.id, d.device_kind) for d in mesh.devices.flat], self.kernels,
                                         # "auto" attention takes the CPU kernel only where its library loads
                                         resolve_impl("auto", False, backend.dtype, mc.head_dim))
        self.manager = CompilationManager(ExecutableCache(cfg.compile_cache_dir, graphs_fingerprint),
                                          options=self.compiler_options)
        self.peak_file = cfg.compile_cache_dir and (Path(cfg.compile_cache_dir).expanduser() / "activation_peak" /
                                                    hashlib.sha256(graphs_fingerprint.encode()).hexdigest()[:40])
        self.penalty = jax.eval_shape(functools.partial(init_penalty_state, cfg.max_num_seqs, mc.vocab_size))
        self.last_tokens = jax.ShapeDtypeStruct((self.seq_buckets[-1],), jnp.int32)
        self.num_blocks: int | None = None
        self.cache_shape: KVCache | None = None
        if backend.fence:
            vmm.register_fence()
        self._jit(model_def)

    def _add_draft(self, draft: LoadedModel, first_layer: int) -> ModelDef:
        """The draft model's weights after the model's in the flat list; its KV layers after the model's."""
        graphdef, state = nnx.split(draft.model)
        leaves, state_def = jax.tree.flatten(state)
        start = len(self.params)
        self.params = self.params + leaves
        return ModelDef(graphdef, state_def, start, len(self.params), first_layer)

    def _jit(self, model_def: ModelDef) -> None:
        rep, params = self.replicated, jax.tree.map(lambda x: x.sharding, self.params)
        cache = self.backend.cache_sharding   # every layer's (a prefix of the cache's pytree)
        model = functools.partial(jax.jit, in_shardings=(params, cache, rep, rep, rep, rep),
                                  out_shardings=(cache, rep, rep, rep), static_argnums=6, donate_argnums=(1, 4, 5))
        run = functools.partial(run_sent_model, model_def=model_def, kernels=self.kernels, mesh=self.mesh,
                                fence=self.backend.fence, block_size=self.cfg.block_size)
        self.model = self.drafting_model = model(run)
        if self.draft_def is not None:
            self.drafting_model = model(functools.partial(run, draft_def=self.draft_def))
            self.drafts = jax.jit(functools.partial(
                run_drafts, draft_def=self.draft_def, num_drafts=self.speculative.num_speculative_tokens,
                block_size=self.cfg.block_size, kernels=self.kernels, mesh=self.mesh),
                in_shardings=(params, cache, rep, rep), out_shardings=(cache, rep), donate_argnums=1)
        self.sampler = jax.jit(run_sent_sampler, in_shardings=rep, out_shardings=rep, static_argnums=6,
                               donate_argnums=(1, 4, 5))
        self.prompt_logprobs = jax.jit(functools.partial(run_prompt_logprobs, model_def=model_def),
                                       in_shardings=(params, rep, rep), out_shardings=rep)
        self.reset = jax.jit(reset_slots, in_shardings=rep, out_shardings=rep, donate_argnums=0)

    # ---- keys ---------------------------------------------------------------------------------------
    def model_key(self, num_tokens: int, num_rows: int, decode_only: bool, width: int = 1,
                  cascade: bool = False) -> GraphKey:
        """width: positions each row samples at (a speculative step's, spec_width). cascade: a decode-only step
        whose rows share prefixes (`share_prefixes`): its graph takes cascade_groups(seq bucket) groups."""
        shape = step_shape(num_tokens, num_rows, decode_only and width == 1, self.ladders,
                           self.kernels.has_decode_kernel or cascade, width)
        return GraphKey("model", (*shape, width, cascade_groups(shape[1]) if cascade else 0), self.num_blocks)

    def share_prefixes(self, block_tables: np.ndarray | None, positions: list[int]) -> list[tuple[np.ndarray, int]]:
        """The groups a decode-only step's rows (their block tables, the position each decodes at) attend by
        cascade: none when the engine has it off (always under contiguous kernels, which have no block tables) or
        the groups fall short of its rule (`apply_cascade_rule`)."""
        if self.cascade_rule is None or len(positions) < self.cascade_rule[0]:
            return []
        # groups too small for the rule are not worked out at all: this runs on every decode step's host path
        groups = share_prefixes(block_tables, np.asarray(positions) + 1, self.cfg.block_size,
                                cascade_groups(bucket_for(len(positions), self.seq_buckets)), self.cascade_rule[0])
        return apply_cascade_rule(groups, self.cascade_rule)

    @property
    def spec_seq_buckets(self) -> tuple[int, ...]:
        """The seq buckets speculative steps run in: up to the one holding speculative_config.max_num_seqs."""
        if self.speculative is None:
            return ()
        top = bucket_for(min(self.speculative.max_num_seqs, self.cfg.max_num_seqs), self.seq_buckets)
        return tuple(s for s in self.seq_buckets if s <= top)

    def keys_of(self, inp: StepInputs) -> list[GraphKey]:
        """The graphs a step's inputs run: model, sampler and (prompt logprobs) the all-position logprobs."""
        keys = [GraphKey("model", inp.model.key, self.num_blocks), GraphKey("sampler", inp.sampler.key)]
        return keys + ([] if inp.next_prompt_ids is None else [GraphKey("prompt", (len(inp.next_prompt_ids),))])

    def runs_draft(self, key: GraphKey) -> bool:
        """A model graph writes the draft model's KV too: in the seq buckets that speculation runs in."""
        return self.draft_def is not None and key.dims[1] <= self.spec_seq_buckets[-1]

    def draft_split(self, key: GraphKey) -> int | None:
        """A model graph that runs no draft model beside one takes the cache's first layers only, the model's (the
        draft's passed through would be copied every step): their count; None: the whole cache."""
        return None if self.draft_def is None or self.runs_draft(key) else self.draft_def.first_layer

    def drafts_key(self, num_rows: int) -> GraphKey:
        """The draft model's drafting of num_rows rows."""
        return GraphKey("drafts", (bucket_for(num_rows, self.spec_seq_buckets),), self.num_blocks)

    def copy_key(self, num_copies: int) -> GraphKey:
        return GraphKey("copy", (copy_bucket(num_copies),), self.num_blocks)

    def reset_key(self, num_seqs: int, width: int) -> GraphKey:
        """Penalty resets of num_seqs newly placed sequences, their prompt + output tokens padded to width."""
        return GraphKey("reset", (bucket_for(num_seqs, self.seq_buckets), bucket_for(width, self.reset_widths)))

    def graph_keys(self) -> list[GraphKey]:
        """Every graph a step can run, cache-bound ones first and largest first (the longest compiles start first,
        so that none is left running alone at the end)."""
        return self.cache_bound_keys() + self.cache_free_keys()

    def cache_bound_keys(self) -> list[GraphKey]:
        models = {self.model_key(*size) for size in step_sizes(self.cfg, self.ladders)}
        if self.cascade_rule is not None:
            models |= {self.model_key(*size, cascade=True) for size in step_sizes(self.cfg, self.ladders)
                       if size[2] and size[1] >= self.cascade_rule[0]}
        if self.spec_seq_buckets:
            width = self.speculative.width
            models |= {self.model_key(tokens, rows, False, width) for tokens, rows, _ in
                       step_sizes(self.cfg, self.ladders, width) if rows <= self.spec_seq_buckets[-1]}
        copies = {self.copy_key(n) for n in pow2_ladder(copy_bucket(1), copy_bucket(self.cfg.max_num_seqs))}
        drafts = [self.drafts_key(s) for s in self.spec_seq_buckets] if self.draft_def is not None else []
        return sorted(models, key=lambda k: k.dims, reverse=True) + drafts[::-1] + sorted(copies, reverse=True)

    def cache_free_keys(self) -> list[GraphKey]:
        prompts = [GraphKey("prompt", (t,)) for t in reversed(self.token_buckets)]
        samplers = [GraphKey("sampler", (s, mode, n, constrained, 1)) for s in reversed(self.seq_buckets)
                    for constrained in (False, True) for mode in sampler_modes(constrained) for n in (0, MAX_LOGPROBS)]
        verifiers = [GraphKey("sampler", (s, mode, n, False, self.speculative.width))
                     for s in reversed(self.spec_seq_buckets) for mode in SAMPLER_MODES for n in (0, MAX_LOGPROBS)]
        return prompts + samplers + verifiers + [self.reset_key(s, w) for s in self.seq_buckets
                                                 for w in self.reset_widths]

    # ---- graphs ------------------------------------------------------------------------------------
    def lower(self, key: GraphKey) -> jax.stages.Lowered:
        """The graph of key, traced and lowered against abstract inputs of its sizes."""
        match key:
            case GraphKey("model", (t, s, _, width, _)):
                inp = self.key_inputs(key)
                split = self.draft_split(key)
                model, cache, features = ((self.drafting_model, self.cache_shape, self.features) if split is None
                                          else (self.model, self.cache_shape[:split], None))
                outputs = self.output_structs(t, s, width)
                return model.lower(self.params, cache, self.last_tokens, *model_args(inp, features, outputs))
            case GraphKey("peak"):   # a stand-in cache: temp memory does not depend on its size (a row: contiguous)
                stand_in = self.backend.cache_structs(self.backend.blocks_per_row or 2)
                rows = self.seq_buckets[-1]
                inp = self.step_inputs(num_tokens=self.token_buckets[-1], num_seqs=rows)
                features = None if self.features is None else \
                    jax.ShapeDtypeStruct((rows, self.features.shape[1]), self.features.dtype)
                return self.drafting_model.lower(self.params, stand_in, self.last_tokens, *model_args(
                    inp, features, self.output_structs(self.token_buckets[-1], rows, 1)))
            case GraphKey("sampler", (s, mode, num_logprobs, constrained, width)):
                layout = Layout.of(self.step_inputs(num_tokens=self.token_buckets[0], num_seqs=s, sampler_mode=mode,
                                                    num_logprobs=num_logprobs, constrained=constrained,
                                                    spec_width=width).sampler)
                sampler_bytes = jax.ShapeDtypeStruct((layout.num_bytes,), jnp.uint8)
                bitmask = jax.ShapeDtypeStruct((s, -(-self.model_config.vocab_size // 32)), jnp.int32) \
                    if constrained else None
                logits = jax.ShapeDtypeStruct((s * width, self.model_config.vocab_size), jnp.float32)
                return self.sampler.lower(logits, self.penalty, sampler_bytes, bitmask, self.last_tokens,
                                          SamplerOutput.structs(s, num_logprobs, width), layout)
            case GraphKey("prompt", (t,)):
                hidden = jax.ShapeDtypeStruct((t, self.model_config.hidden_size), self.dtype)
                return self.prompt_logprobs.lower(self.params, hidden, np.zeros(t, np.int32))
            case GraphKey("drafts", (s,)):
                inp = draft_inputs(np.zeros(0), np.zeros(0), np.zeros((0, self.max_blocks_per_seq)), np.zeros(0), s)
                return self.drafts.lower(self.params, self.cache_shape[self.draft_def.first_layer:], inp,
                                         self.features)
            case GraphKey("copy", (n,)):
                ids = np.zeros(n, np.int32)
                return copy_blocks.lower(self.cache_shape, ids, ids, mesh=self.mesh)
            case GraphKey("reset", (rows, width)):
                ids = np.zeros((rows, width), np.int32)
                return self.reset.lower(self.penalty, np.zeros(rows, np.int32), ids, ids)
        raise ValueError(f"no graph of key {key}")

    def get(self, key: GraphKey) -> jax.stages.Compiled:
        """The executable of key, compiled now if it was not (counted once serving)."""
        return self.manager.get(key, functools.partial(self.lower, key))

    def key_inputs(self, key: GraphKey) -> StepInputs:
        """Host inputs of a step of the sizes of a model graph's key."""
        t, s, decode_only, width, groups = key.dims
        return self.step_inputs(num_tokens=t, num_seqs=s, decode_only=decode_only, spec_width=width,
                                cascade_groups=groups)

    def output_structs(self, num_tokens: int, num_seqs: int, width: int) -> tuple:
        """A model graph's (logits, hidden) outputs, the buffers it writes over (run_model)."""
        return (jax.ShapeDtypeStruct((num_seqs * width, self.model_config.vocab_size), jnp.float32),
                jax.ShapeDtypeStruct((num_tokens, self.model_config.hidden_size), self.dtype))

    def compiler_options(self, key: GraphKey) -> dict:
        """XLA's options for the graph of key. On GPU, graphs that run the model's weights (model, prompt logprobs,
        drafting, the peak stand-in) never merge dots: XLA's dot merger concatenates the weights of dots sharing an
        operand (q, k and v; gate and up) into a new array on every step, weight traffic a memory-bound step pays
        twice.
        They take cuBLAS GEMMs over Triton's above TRITON_GEMM_MAX_ROWS rows, or with FP8 weights above
        W8A16_MAX_ROWS: cuBLASLt's FP8 GEMMs beat Triton's at every row count, and the W8A16 GEMMs below need
        Triton to fuse the weight's conversion."""
        weights = ("model", "prompt", "drafts")
        if self.mesh.devices.flat[0].platform == "cpu" or (key != PEAK and key.kind not in weights):
            return {}
        rows = self.token_buckets[-1] if key == PEAK else key.dims[0]
        cublas = rows > (W8A16_MAX_ROWS if self.quantization == "fp8" else TRITON_GEMM_MAX_ROWS)
        return {"xla_gpu_dot_merger_threshold_mb": 0} | ({"xla_gpu_enable_triton_gemm": False} if cublas else {})

    # ---- start-up ----------------------------------------------------------------------------------
    def activation_peak(self) -> int:
        """XLA's temp memory of the largest step's model, sampler and prompt-logprob graphs (summed: safe whichever
        runs), reserved before the KV cache takes what is left. Measured once per fingerprint and kept beside the
        compile cache: a warm start then neither traces nor loads those graphs (~1 s of a CPU start)."""
        if self.peak_file and self.peak_file.exists():
            peak = int(self.peak_file.read_text())
        else:
            peak = self.measure_activation_peak()
            if self.peak_file:
                self.peak_file.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.peak_file.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(str(peak))
                tmp.replace(self.peak_file)   # atomic: a concurrent start reads a whole file or none
        print(f"activation peak of the largest step: {peak / 2**20:.1f} MiB", file=sys.stderr)
        return peak

    def measure_activation_peak(self) -> int:
        """The model's graph on a stand-in cache is only looked at; the others are kept, and (precompile) every
        graph that does not take the cache compiles beside them."""
        with self.manager.timed("peak_s"):
            kept = [self.largest_sampler_key(), GraphKey("prompt", (self.token_buckets[-1],))]
            self.manager.submit({PEAK: functools.partial(self.lower, PEAK)}, peek=True)
            self.manager.submit({key: functools.partial(self.lower, key) for key in kept})
            if self.cfg.precompile:
                self.manager.submit({key: functools.partial(self.lower, key) for key in self.cache_free_keys()})
            executables = self.manager.wait([PEAK, *kept]).values()
            return sum(getattr(e.memory_analysis(), "temp_size_in_bytes", 0) for e in executables)

    def largest_sampler_key(self) -> GraphKey:
        """The sampler of the most rows (positions of a speculative step's rows count), with every option on."""
        plain = GraphKey("sampler", (self.seq_buckets[-1], "filter", MAX_LOGPROBS, True, 1))
        if not self.spec_seq_buckets or self.spec_seq_buckets[-1] * self.speculative.width <= self.seq_buckets[-1]:
            return plain
        return GraphKey("sampler", (self.spec_seq_buckets[-1], "filter", MAX_LOGPROBS, False, self.speculative.width))

    def bind_cache(self, num_blocks: int) -> None:
        """The cache's size, from here on in the keys of the graphs that take it."""
        self.num_blocks, self.cache_shape = num_blocks, self.backend.cache_structs(num_blocks)

    def precompile(self) -> None:
        """Compile every graph a step can run, before serving; the executable cache makes restarts fast."""
        with self.manager.timed("precompile_s"):
            self.manager.compile_all({key: functools.partial(self.lower, key) for key in self.graph_keys()})
        self.manager.precompiled = True

    def prefetch(self) -> None:
        """A lazy start: the graphs the last lazy start of this engine wanted first, loaded on the compile threads
        while the cache is allocated and the first requests prepared."""
        keys = self.manager.cache.first_wanted(self.graph_keys())
        self.manager.prefetch({key: functools.partial(self.lower, key) for key in keys})

    def start_serving(self) -> None:
        """From now on a compile stalls every stream: each is counted."""
        self.manager.started = True

    # ---- inputs ------------------------------------------------------------------------------------
    def step_inputs(self, **kw) -> StepInputs:
        """build_step_inputs with this engine's constants. Rows that all decode one token run the decode kernel's
        graph where there is one (`decode_only` forces it, for the compile-time dummies); no rows: a dummy."""
        counts = kw.get("counts", ())
        decode_only = kw.pop("decode_only", len(counts) > 0 and all(c == 1 for c in counts))
        if self.features is not None:
            kw.setdefault("feature_index", ())
        if "block_tables" not in kw and "kv_rows" not in kw:
            cells = np.zeros((0,) if self.kernels.blocks_per_row else (0, self.max_blocks_per_seq), np.int32)
            kw |= kv_addressing(cells, self.kernels.blocks_per_row)
        return build_step_inputs(block_size=self.cfg.block_size, scratch_slot=self.cfg.max_num_seqs,
                                 eos_token_ids=self.eos_token_ids,
                                 decode_only=decode_only and (self.kernels.has_decode_kernel or
                                                              kw.get("cascade_groups", 0) > 0), **kw)


def cascade_groups(num_seqs: int) -> int:
    """Groups a cascade graph of num_seqs rows takes: each has two members at least."""
    return min(CASCADE_MAX_GROUPS, num_seqs // 2)


def apply_cascade_rule(groups: list[tuple[np.ndarray, int]], rule: tuple[int, int]) -> list[tuple[np.ndarray, int]]:
    """The groups (rows, shared tokens) a step attends by cascade under `rule` (members a group needs, key reads
    the kept groups must save together): none if they save too few."""
    kept = [(rows, shared) for rows, shared in groups if len(rows) >= rule[0]]
    return kept if sum(shared * (len(rows) - 1) for rows, shared in kept) >= rule[1] else []


def cascade_rule(mode: str, kernels: AttentionKernels, sliding_window: int | None) -> tuple[int, int] | None:
    """(members a group needs, key reads saved) from which a decode-only step attends by cascade
    (config.cascade_attention); None: never. It needs paged blocks (shared by the prefix cache), no sliding window
    and the Pallas (Mosaic GPU's on Hopper, else or when named Triton's) or reference decode."""
    why_not = ("a sliding window" if sliding_window is not None else
               "vattention's contiguous kernels" if kernels.blocks_per_row is not None else
               "decode_attention='cuda'" if kernels.decode == "cuda" else None)
    if mode == "on" and why_not:
        raise ValueError(f"cascade_attention='on' cannot run with {why_not}; set it to 'auto' or 'off'")
    if mode == "off" or why_not:
        return None
    if mode == "on":
        return 2, 1
    if kernels.decode != "pallas":
        return None
    mosaic = kernels.decode_backend == "mosaic" or (kernels.decode_backend == "auto" and not triton_in_auto(False))
    return CASCADE_MOSAIC_MIN_MEMBERS if mosaic else CASCADE_MIN_MEMBERS, CASCADE_MIN_SAVED_KEYS
