"""The model runner: device state (weights, paged KV cache, penalty state), the device slots of the running
sequences, bucketed static-shape inputs, and the compiled graphs of a step — the model (embed -> layers with
scatter KV writes + ragged paged attention -> logits of each row's last token) per (token bucket, seq bucket),
the sampler per (seq bucket, mode, logprobs), all-position prompt logprobs per token bucket — with the cache and
penalty state donated. Every graph compiles before serving (`precompile`); `execute` consumes one
`SchedulerOutput`: its host work makes one `DeviceStep`, which `launch` runs (so does every worker process of a
multi-host engine, engine/distributed.py)."""
from __future__ import annotations

import atexit
import dataclasses
import functools
import math
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from custom_calls import vmm
from jaxserve.cache.block_table import BlockTable, KVSlotTable
from jaxserve.cache.kv_cache import (CPU_MAX_KV_BYTES, CrossLayerKV, KVCache, _copy_blocks,
                                     allocate_cross_layer_cache, allocate_kv_cache, copy_bucket,
                                     describe_kv_capacity, kv_bytes_per_block, num_blocks_for_memory,
                                     pad_block_copies)
from jaxserve.cache.vattention import (PAGE_SIZE, CudaPageMapper, FakePageMapper, PageMapper, VmmGeometry,
                                       xla_claims_gpu_memory)
from jaxserve.config import SAMPLER_MODES, EngineConfig
from jaxserve.engine.compilation import CompilationManager, ExecutableCache, Lower, fingerprint
from jaxserve.engine.sampler import PenaltyState, SamplerOutput, init_penalty_state, mode_for, reset_slots, sample
from jaxserve.engine.sampling_params import MAX_LOGPROBS
from jaxserve.engine.scheduler import SchedulerOutput, StepRow
from jaxserve.engine.sequence import PENDING, Sequence
from jaxserve.engine.step_inputs import ModelInputs, SamplerInputs, StepInputs, build_step_inputs, pad
from jaxserve.models.attention import AttentionKernels, PagedAttention, resolve_attention_kernels
from jaxserve.models.loader import LoadedModel
from jaxserve.models.sharding import CROSS_LAYER_KV_CACHE, KV_CACHE, TP, cache_kv_heads

MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8
MIN_RESET_WIDTH = 64   # penalty resets pad prompt + output tokens to a power of four from here (few graphs)
PROMPT_LOGPROBS_ROWS = 256   # prompt logprobs take [rows, V] logits at a time, not [T, V] (5 GB at 4K x 128K)
# vattention's page size on CPU, where FakePageMapper stands in for the driver: the GPU's 2 MiB, so that the CPU
# runs the GPU's geometry; tests lower it so that a tiny model's prompts span many pages.
CPU_VMM_PAGE_SIZE = PAGE_SIZE
PEAK_MODEL = ("peak", "model")   # the largest step's model on a stand-in cache: compiled for its memory analysis only
# GPU graphs of more rows than this take cuBLAS GEMMs, not XLA's autotuned Triton ones (H100, 8B shapes, same run:
# cold start 62.4 -> 43.6 s with every graph on cuBLAS, 256 x 512/128 greedy 5,822 -> 6,084 tok/s; but batch-1
# decode, 16 rows, 156 -> 110 tok/s: small GEMMs keep Triton)
TRITON_GEMM_MAX_ROWS = 64


def pow2_ladder(low: int, high: int, factor: int = 2) -> tuple[int, ...]:
    """low, low * factor, ... (powers of two for factor 2, 4, ...) below high, then high itself."""
    ladder = [low * factor ** i for i in range(max(0, math.ceil(math.log(high / low, factor))) + 1)]
    return tuple([x for x in ladder if x < high] + [high])


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


@dataclass(slots=True)
class DeviceStep:
    """What one `execute` launches, as host (numpy) data: block copies, penalty resets of newly placed sequences,
    the step's bucketed inputs. Each is None when the step has none."""
    copies: tuple[np.ndarray, np.ndarray] | None = None            # block ids src -> dst, unpadded
    resets: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None   # slots [R], prompt and output ids [R, W]
    inputs: StepInputs | None = None

    @property
    def empty(self) -> bool:
        return self.copies is None and self.resets is None and self.inputs is None


def run_model(params, kv_cache, last_tokens, inp: ModelInputs, *, graphdef, kernels: AttentionKernels, mesh: Mesh,
              vmm_fence: bool = False):
    """The model graph: (kv_cache, f32 logits [S, V] of each row's token, hidden states [T, H])."""
    model = nnx.merge(graphdef, params)
    # Async scheduling: a decode's input may be the token the previous step sampled, still on the device.
    token_ids = jnp.where(inp.prev_index >= 0, last_tokens[jnp.maximum(inp.prev_index, 0)], inp.token_ids)
    hidden, kv_cache = model(token_ids, inp.positions, kv_cache, PagedAttention(inp.attn, kernels, mesh))
    logits = model.logits(hidden[inp.logits_indices])
    if vmm_fence:   # vattention on GPU: the logits follow every cache read; unmaps wait for this fence
        logits = vmm.fence(logits)
    return kv_cache, logits, hidden


def run_sampler(logits, penalty: PenaltyState, inp: SamplerInputs, *, num_last_tokens: int):
    """The sampler graph: (penalty, SamplerOutput, this step's samples padded to num_last_tokens)."""
    out, penalty = sample(logits, inp.sampling, penalty, inp.slot_ids, inp.sample_mask,
                          num_logprobs=inp.num_logprobs, mode=inp.mode)
    return penalty, out, jnp.zeros(num_last_tokens, jnp.int32).at[:out.tokens.shape[0]].set(out.tokens)


def run_prompt_logprobs(params, hidden, next_prompt_ids, *, graphdef) -> PromptLogprobs:
    """All-position logprobs (run only for steps that serve a prompt_logprobs request), PROMPT_LOGPROBS_ROWS
    tokens at a time."""
    model, rows = nnx.merge(graphdef, params), math.gcd(len(hidden), PROMPT_LOGPROBS_ROWS)

    def chunk(args):
        h, nxt = args
        logprobs = jax.nn.log_softmax(model.logits(h), axis=-1)
        target = jnp.take_along_axis(logprobs, jnp.maximum(nxt, 0)[:, None], axis=-1)[:, 0]
        top, ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
        return PromptLogprobs(target, ids.astype(jnp.int32), top)

    out = jax.lax.map(chunk, (hidden.reshape(-1, rows, hidden.shape[-1]), next_prompt_ids.reshape(-1, rows)))
    return jax.tree.map(lambda x: x.reshape(len(hidden), *x.shape[2:]), out)


def tensor_parallel_mesh(loaded: LoadedModel, cfg: EngineConfig) -> Mesh:
    """The mesh the model was loaded on, which must be the config's tensor_parallel_size devices."""
    if (tp := loaded.mesh.shape[TP]) != cfg.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size} but the model was loaded on {tp} "
                         f"device(s): load it with tensor_parallel_size={cfg.tensor_parallel_size} "
                         f"(models.loader.load_run, or load_model(mesh=make_mesh({cfg.tensor_parallel_size})))")
    return loaded.mesh

# Knobs only the host reads (memory_fraction acts through num_blocks, which the fingerprint adds): changing one
# must not make a warm start recompile.
HOST_ONLY_KNOBS = ("compile_cache_dir", "precompile", "max_queued_requests", "max_queued_tokens", "watermark",
                   "memory_fraction", "min_prefill_chunk", "vattention_lookahead_tokens")


def graph_knobs(cfg: EngineConfig) -> dict:
    """The engine knobs the compiled graphs may depend on: what the executable cache's fingerprint covers."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in HOST_ONLY_KNOBS}


class ModelRunner:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig):
        self.cfg, self.model_config = cfg, loaded.config
        graphdef, self.params = nnx.split(loaded.model)
        mc = loaded.config
        self.mesh = tensor_parallel_mesh(loaded, cfg)
        self.cross_layer = cfg.kv_backend == "vattention"   # vattention's megacache: one K, V pair of all layers
        self.replicated = NamedSharding(self.mesh, P())
        self.cache_sharding = NamedSharding(self.mesh, CROSS_LAYER_KV_CACHE if self.cross_layer else KV_CACHE)
        self.kv_heads = cache_kv_heads(mc.num_kv_heads, cfg.tensor_parallel_size)
        self.dtype = dtype = loaded.model.embed_tokens.embedding[...].dtype
        self.token_buckets, self.seq_buckets = bucket_ladders(cfg)
        self.max_blocks_per_seq = -(-cfg.max_model_len // cfg.block_size)
        self.reset_widths = pow2_ladder(MIN_RESET_WIDTH, cfg.max_model_len, factor=4)
        self.free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        self.slot_of: dict[int, int] = {}     # seq_id -> device slot: block-table row and penalty state
        self.prev_rows: dict[int, int] = {}   # seq_id -> row of the last launched step that samples it
        self.eos_token_ids = loaded.eos_token_ids
        self.vmm_on_device = cfg.kv_backend == "vattention" and self.mesh.devices.flat[0].platform != "cpu"
        if self.vmm_on_device:
            vmm.register_fence()
        # vattention: the rows' layout now (the kernels address them), their page pool once the graphs exist
        layout = self._vmm_layout(dtype) if cfg.kv_backend == "vattention" else None
        contiguous = layout is not None and cfg.vattention_kernels == "contiguous"
        self.kernels = resolve_attention_kernels(cfg.decode_attention, cfg.prefill_attention, mc.head_dim,
                                                 layout.blocks_per_slot if contiguous else None)
        self.block_table = (KVSlotTable(cfg.max_num_seqs, layout.blocks_per_slot) if contiguous
                            else BlockTable(cfg.max_num_seqs, self.max_blocks_per_seq))
        self.graphs = CompilationManager(ExecutableCache(cfg.compile_cache_dir, fingerprint(
            mc, graph_knobs(cfg), str(dtype), [(d.id, d.device_kind) for d in self.mesh.devices.flat],
            self.kernels)), options=self.compiler_options)
        self.on_launch: Callable[[DeviceStep], None] | None = None   # sees each step before it launches
        self._jit_graphs(graphdef)
        self.penalty = jax.jit(init_penalty_state, static_argnums=(0, 1), out_shardings=self.replicated)(
            cfg.max_num_seqs, mc.vocab_size)
        self.last_tokens = jnp.zeros(self.seq_buckets[-1], jnp.int32,   # the previous step's samples, on device
                                     device=self.replicated)
        # vattention: the cache viewed as blocks is the whole virtual range (identity block ids); paged: the pool
        self.vmm_geometry = None if layout is None else self._vmm_pool(layout, dtype)
        self.num_blocks = self._kv_blocks(dtype) if self.vmm_geometry is None else \
            self.vmm_geometry.rows * self.vmm_geometry.blocks_per_slot
        self.graphs.cache.fingerprint += f" num_blocks={self.num_blocks}"   # the graphs from here on depend on it
        self.cache_shape = self.cache_structs(self.num_blocks, dtype)
        if cfg.precompile:   # before the cache takes the memory: compiling (autotuning) needs room to run kernels
            self.precompile()
        self.page_mapper: PageMapper | None = None if self.vmm_geometry is None else self._page_mapper()
        allocate = allocate_cross_layer_cache if self.cross_layer else allocate_kv_cache
        self.kv_cache = self._vmm_cache() if self.vmm_on_device else allocate(
            mc.num_layers, self.num_blocks, cfg.block_size, self.kv_heads, mc.head_dim, dtype, self.cache_sharding)

    def _jit_graphs(self, graphdef) -> None:
        """The step's graphs, their shardings explicit so that XLA never moves the weights or the cache: weights
        as loaded, the cache split on kv heads (donated: updated in place), everything else replicated — the
        model's logits gathered from the vocab-split LM head for the sampler, which runs whole on every device."""
        rep, params = self.replicated, jax.tree.map(lambda x: x.sharding, self.params)
        cache = (CrossLayerKV(self.cache_sharding, self.cache_sharding) if self.cross_layer
                 else [(self.cache_sharding,) * 2] * self.model_config.num_layers)
        self._model = jax.jit(functools.partial(run_model, graphdef=graphdef, kernels=self.kernels, mesh=self.mesh,
                                                vmm_fence=self.vmm_on_device),
                              in_shardings=(params, cache, rep, rep), out_shardings=(cache, rep, rep),
                              donate_argnums=1)
        self._sampler = jax.jit(functools.partial(run_sampler, num_last_tokens=self.seq_buckets[-1]),
                                in_shardings=rep, out_shardings=rep, donate_argnums=1)
        self._prompt_logprobs = jax.jit(functools.partial(run_prompt_logprobs, graphdef=graphdef),
                                        in_shardings=(params, rep, rep), out_shardings=rep)
        self._reset_slots = jax.jit(reset_slots, in_shardings=rep, out_shardings=rep, donate_argnums=0)

    def compiler_options(self, key: tuple) -> dict:
        """XLA's options for the graph of key: see TRITON_GEMM_MAX_ROWS (model and prompt-logprob graphs' rows)."""
        rows = self.token_buckets[-1] if key == PEAK_MODEL else key[1] if key[0] in ("model", "prompt") else 0
        on_gpu = self.mesh.devices.flat[0].platform != "cpu"
        return {"xla_gpu_enable_triton_gemm": False} if on_gpu and rows > TRITON_GEMM_MAX_ROWS else {}

    def _kv_blocks(self, dtype) -> int:
        """The config's num_blocks, or as many as fit each device's memory left by weights and activations."""
        mc, cfg = self.model_config, self.cfg
        bytes_per_block = kv_bytes_per_block(mc.num_layers, cfg.block_size,   # on each device
                                             self.kv_heads // cfg.tensor_parallel_size, mc.head_dim, dtype)
        num_blocks = cfg.num_blocks or self._blocks_that_fit(bytes_per_block, dtype)
        if jax.process_count() > 1:   # multi-host: every process holds the same pool, the one that fits them all
            num_blocks = int(multihost_utils.process_allgather(np.int32(num_blocks)).min())
        print(describe_kv_capacity(num_blocks, cfg.block_size, bytes_per_block, cfg.tensor_parallel_size),
              file=sys.stderr)
        return num_blocks

    def _vmm_layout(self, dtype) -> VmmGeometry:
        """vattention's rows, a slot per sequence + the null row, in two cross-layer ranges (K and V: a token's
        every layer together, kv_cache.CrossLayerKV); its num_pages a placeholder until _vmm_pool."""
        cfg, mc, page_size = self.cfg, self.model_config, PAGE_SIZE if self.vmm_on_device else CPU_VMM_PAGE_SIZE
        token_bytes = mc.num_layers * self.kv_heads * mc.head_dim * jnp.dtype(dtype).itemsize   # tp is 1
        return VmmGeometry(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size, token_bytes, 1, page_size)

    def _vmm_pool(self, layout: VmmGeometry, dtype) -> VmmGeometry:
        """The layout with its page pool: the config's num_blocks as the pages their tokens need (+ the null
        block's), or as many pages as fit beside weights and activations; a pool page is a page in each range."""
        cfg, page_size, token_bytes = self.cfg, layout.page_size, layout.token_bytes
        num_ranges = 2
        range_bytes = num_ranges * layout.rows * layout.slot_bytes
        if self.vmm_on_device and xla_claims_gpu_memory():   # the pool's pages would find no memory to map
            raise ValueError("kv_backend=vattention maps its KV pages outside XLA's allocator, which claims most of "
                             "the GPU when JAX starts: set XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX starts "
                             "(`jaxserve serve` and `generate` do when the config says vattention)")
        if not self.vmm_on_device and range_bytes > CPU_MAX_KV_BYTES:   # the CPU stand-in allocates it all
            raise ValueError(f"kv_backend=vattention on CPU allocates the whole virtual range, "
                             f"{range_bytes / 2**30:.1f} GiB (> {CPU_MAX_KV_BYTES / 2**30:.0f} GiB): lower "
                             "max_num_seqs or max_model_len")
        num_pages = (layout.pages_for(cfg.block_size) + layout.pages_for((cfg.num_blocks - 1) * cfg.block_size)
                     if cfg.num_blocks else self._blocks_that_fit(num_ranges * page_size, dtype))
        geometry = dataclasses.replace(layout, num_pages=num_pages)
        print(f"KV cache (vattention): {num_pages:,} pages of {page_size / 2**20:g} MiB in each of "
              f"{num_ranges} ranges = {num_pages * page_size // token_bytes:,} tokens "
              f"({num_pages * num_ranges * page_size / 2**30:.2f} GiB); {geometry.rows} rows of "
              f"{geometry.tokens_per_slot:,} tokens reserved", file=sys.stderr)
        return geometry

    def _page_mapper(self) -> PageMapper:
        """The C++ manager on GPU (its page pool is created now: after precompile, like the paged cache), the
        fake one on CPU. The cache arrays alias its memory: they are dropped at exit, before it goes."""
        g = self.vmm_geometry
        if not self.vmm_on_device:
            return FakePageMapper(g.num_pages, g.rows, g.pages_per_slot)
        mapper = CudaPageMapper(g, num_tensors=2, devices=[d.local_hardware_id for d in self.mesh.local_devices])
        atexit.register(_drop_vmm_cache, weakref.ref(self))
        return mapper

    def _vmm_cache(self) -> CrossLayerKV:
        """K and V as the manager's two ranges, zero copy ([rows * blocks_per_slot, layers, block, Hkv, D])."""
        struct = self.cache_shape.k

        def export(tensor: int) -> jax.Array:
            pieces = self.page_mapper.export(tensor, struct.shape, struct.dtype)
            return jax.make_array_from_single_device_arrays(struct.shape, self.cache_sharding, pieces)
        return CrossLayerKV(export(0), export(1))

    def _blocks_that_fit(self, bytes_per_block: int, dtype) -> int:
        """Blocks that fit the memory left on each of this engine's own devices (a data-parallel replica's are not
        the first device), after the weights and the activation peak — whose graphs compile first, with (precompile)
        every graph that does not depend on the cache's size beside them."""
        with self.graphs.timed("peak_s"):
            self._submit_peak(dtype)
            if self.cfg.precompile:
                self.graphs.submit(self.cache_free_graphs())
            peak = self.activation_bytes(dtype)
        return min(num_blocks_for_memory(bytes_per_block, activation_peak_bytes=peak,
                                         fraction=self.cfg.memory_fraction, device=d) for d in self.mesh.local_devices)

    def cache_structs(self, num_blocks: int, dtype) -> KVCache:
        """The cache, abstract: what graphs compile against."""
        mc, block = self.model_config, (self.cfg.block_size, self.kv_heads, self.model_config.head_dim)
        if self.cross_layer:
            struct = jax.ShapeDtypeStruct((num_blocks, mc.num_layers, *block), dtype, sharding=self.cache_sharding)
            return CrossLayerKV(struct, struct)
        struct = jax.ShapeDtypeStruct((num_blocks, *block), dtype, sharding=self.cache_sharding)
        return [(struct, struct)] * mc.num_layers

    def activation_bytes(self, dtype) -> int:
        """XLA's temp memory for the largest bucket's model, sampler and prompt-logprob graphs (summed: safe
        whichever runs): reserved before the KV cache takes what is left."""
        executables = self.graphs.wait(self._submit_peak(dtype)).values()
        peak = sum(getattr(e.memory_analysis(), "temp_size_in_bytes", 0) for e in executables)
        print(f"activation peak of the largest step: {peak / 2**20:.1f} MiB", file=sys.stderr)
        return peak

    def _submit_peak(self, dtype) -> list[tuple]:
        """The activation peak's graphs, submitted (if not yet) and their keys: the largest bucket's model against a
        2-block stand-in cache (temp memory does not depend on the cache's size; contiguous kernels: one row, they
        need whole rows), a peek, compiled first as the longest; then its sampler (filter mode, logprobs) and
        prompt logprobs, real graphs, kept."""
        stand_in = self.cache_structs(self.kernels.blocks_per_slot or 2, dtype)
        inp = self.step_inputs(num_tokens=self.token_buckets[-1], num_seqs=self.seq_buckets[-1]).model
        self.graphs.submit({PEAK_MODEL: lambda: self._model.lower(self.params, stand_in, self.last_tokens, inp)},
                           peek=True)
        real = dict([self._sampler_graph(self.seq_buckets[-1], "filter", MAX_LOGPROBS),
                     self._prompt_graph(self.token_buckets[-1])])
        self.graphs.submit(real)
        return [PEAK_MODEL, *real]

    def precompile(self) -> None:
        """Compile every graph the engine can run, before it serves (the cache's size known); the persistent cache
        makes restarts fast."""
        with self.graphs.timed("precompile_s"):
            self.graphs.compile_all({**self.cache_bound_graphs(), **self.cache_free_graphs()})
        self.graphs.precompiled = True

    def cache_bound_graphs(self) -> dict[tuple, Lower]:
        """The graphs that take the cache (shaped by its size), largest first (the longest compiles start first, so
        that none is left running alone at the end): the model per bucket (and the decode-only graph per seq bucket),
        block copies per padded size."""
        graphs = {}
        for t, s, decode_only in sorted(self._model_shapes(), reverse=True):
            inp = self.step_inputs(num_tokens=t, num_seqs=s, decode_only=decode_only)
            graphs[("model", *inp.model.key)] = functools.partial(self._lower_model, inp.model)
        for n in pow2_ladder(copy_bucket(1), copy_bucket(self.cfg.max_num_seqs)):
            graphs[("copy", n)] = functools.partial(self._lower_copy, np.zeros(n, np.int32))
        return graphs

    def cache_free_graphs(self) -> dict[tuple, Lower]:
        """The graphs that do not depend on the cache's size, largest first: prompt logprobs per token bucket, the
        sampler per seq bucket, mode and logprobs, penalty resets per padded size."""
        graphs = dict(self._prompt_graph(t) for t in reversed(self.token_buckets))
        graphs |= (self._sampler_graph(s, mode, n) for s in reversed(self.seq_buckets) for mode in SAMPLER_MODES
                   for n in (0, MAX_LOGPROBS))
        graphs |= {("reset", s, w): functools.partial(self._lower_reset, s, w)
                   for s in self.seq_buckets for w in self.reset_widths}
        return graphs

    def _sampler_graph(self, num_seqs: int, mode: str, num_logprobs: int) -> tuple[tuple, Lower]:
        inp = self.step_inputs(num_tokens=self.token_buckets[0], num_seqs=num_seqs, sampler_mode=mode,
                               num_logprobs=num_logprobs).sampler
        return ("sampler", *inp.key), functools.partial(self._lower_sampler, inp)

    def _prompt_graph(self, num_tokens: int) -> tuple[tuple, Lower]:
        return ("prompt", num_tokens), functools.partial(self._lower_prompt_logprobs, num_tokens)

    def _model_shapes(self) -> list[tuple[int, int, bool]]:
        """Every (token bucket, seq bucket) a step can pad to — a seq bucket above a token bucket only where the
        seq bucket below it is smaller (a step has at most one sequence per token) — and the decode-only ones."""
        seqs = self.seq_buckets
        shapes = [(t, s, False) for t in self.token_buckets for i, s in enumerate(seqs) if i == 0 or seqs[i - 1] < t]
        if self.kernels.has_decode_kernel:
            shapes += [(bucket_for(s, self.token_buckets), s, True) for s in self.seq_buckets]
        return shapes

    def _lower_model(self, inp: ModelInputs):
        return self._model.lower(self.params, self.cache_shape, self.last_tokens, inp)

    def _lower_sampler(self, inp: SamplerInputs):
        logits = jax.ShapeDtypeStruct((len(inp.slot_ids), self.model_config.vocab_size), jnp.float32)
        return self._sampler.lower(logits, self.penalty, inp)

    def _lower_prompt_logprobs(self, num_tokens: int):
        hidden = jax.ShapeDtypeStruct((num_tokens, self.model_config.hidden_size), self.dtype)
        return self._prompt_logprobs.lower(self.params, hidden, np.zeros(num_tokens, np.int32))

    def _lower_copy(self, ids: np.ndarray):
        return _copy_blocks.lower(self.cache_shape, ids, ids, mesh=self.mesh)

    def _lower_reset(self, num_rows: int, width: int):
        ids = np.zeros((num_rows, width), np.int32)
        return self._reset_slots.lower(self.penalty, np.zeros(num_rows, np.int32), ids, ids)

    def step_inputs(self, **kw) -> StepInputs:
        """build_step_inputs with this engine's constants. Steps whose rows all decode one token run the decode
        kernel's graph where there is one (`decode_only` forces it, for the compile-time dummies)."""
        counts = kw.get("counts", ())
        decode_only = kw.pop("decode_only", len(counts) > 0 and all(c == 1 for c in counts))
        if "block_tables" not in kw and "kv_slots" not in kw:   # the compile-time dummies: no rows
            kw |= self.kv_addressing(np.zeros(0, np.int32))
        return build_step_inputs(block_size=self.cfg.block_size, scratch_slot=self.cfg.max_num_seqs,
                                 eos_token_ids=self.eos_token_ids,
                                 decode_only=decode_only and self.kernels.has_decode_kernel, **kw)

    def kv_addressing(self, slots: np.ndarray) -> dict:
        """Where the KV of the sequences in these device slots lies, as build_step_inputs takes it: their
        block-table rows or, under contiguous kernels, their vattention slots (no block ids on the host)."""
        cells = self.block_table.table[slots]
        if self.kernels.blocks_per_slot is None:
            return dict(block_tables=cells)
        return dict(kv_slots=cells, blocks_per_slot=self.kernels.blocks_per_slot)

    def compile_step(self, inp: StepInputs) -> list[jax.stages.Compiled]:
        """The model and sampler executables of inp's step, compiled now if need be (the bucket sweep)."""
        return [self.graphs.get(("model", *inp.model.key), functools.partial(self._lower_model, inp.model)),
                self.graphs.get(("sampler", *inp.sampler.key), functools.partial(self._lower_sampler, inp.sampler))]

    def run(self, inp: StepInputs) -> tuple[SamplerOutput, PromptLogprobs | None]:
        """One step on ready inputs through the compiled graphs: device arrays, no sync."""
        model, sampler = self.compile_step(inp)
        self.kv_cache, logits, hidden = model(self.params, self.kv_cache, self.last_tokens, inp.model)
        self.penalty, out, self.last_tokens = sampler(logits, self.penalty, inp.sampler)
        if inp.next_prompt_ids is None:
            return out, None
        num_tokens = len(inp.next_prompt_ids)
        prompt = self.graphs.get(*self._prompt_graph(num_tokens))
        return out, prompt(self.params, hidden, inp.next_prompt_ids)

    def execute(self, out: SchedulerOutput):
        """Apply the step's slot, block-table and cache changes and launch it: device outputs (None without
        rows), no sync."""
        for seq_id in out.preempted + out.finished:
            self._release(seq_id)
        for seq in out.placed:
            self.slot_of[seq.seq_id] = self.free_slots.pop()
        for seq_id, start, block_ids in out.block_updates:
            self.block_table.write(self.slot_of[seq_id], start, block_ids)
        step = DeviceStep(out.copies if len(out.copies[0]) else None, self._penalty_resets(out.placed))
        if out.rows:
            step.inputs = self.prepare_inputs(out.rows)
            self.prev_rows = {row.seq.seq_id: i for i, row in enumerate(out.rows) if row.samples}
        if self.on_launch is not None and not step.empty:
            self.on_launch(step)
        return self.launch(step)

    def launch(self, step: DeviceStep):
        """Run a step's device work: its outputs (None without inputs) as device arrays, no sync."""
        if step.copies is not None:
            self._copy_blocks(*step.copies)
        if step.resets is not None:
            self._reset_penalties(*step.resets)
        return None if step.inputs is None else self.run(step.inputs)

    def _release(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)   # None: finished before it was ever placed
        if slot is not None:
            self.block_table.clear_row(slot)
            self.free_slots.append(slot)

    def _copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """In chunks of the largest precompiled copy graph (a vattention fork copies a whole prompt); a chunk's
        sources are never another's destinations (copy-on-write and fork copies go to fresh blocks)."""
        chunk = copy_bucket(self.cfg.max_num_seqs)
        for i in range(0, len(src), chunk):
            s, d = pad_block_copies(src[i:i + chunk], dst[i:i + chunk], self.num_blocks)
            copy = self.graphs.get(("copy", len(s)), functools.partial(self._lower_copy, s))
            self.kv_cache = copy(self.kv_cache, s, d)

    def _penalty_resets(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Fresh penalty state for newly placed sequences (prompt mask; counts of tokens already generated): slots,
        prompt and output ids, padded to a seq bucket (padding rows reset the scratch slot) and a width of
        `reset_widths`."""
        if not seqs:
            return None
        outputs = [s.confirmed_output_ids for s in seqs]
        rows = bucket_for(len(seqs), self.seq_buckets)
        width = bucket_for(max(s.num_prompt_tokens + len(o) for s, o in zip(seqs, outputs)), self.reset_widths)
        prompt, output = np.full((2, rows, width), -1, np.int32)
        for i, (s, o) in enumerate(zip(seqs, outputs)):
            prompt[i, :s.num_prompt_tokens] = s.token_ids[:s.num_prompt_tokens]
            output[i, :len(o)] = o
        return pad([self.slot_of[s.seq_id] for s in seqs], rows, fill=self.cfg.max_num_seqs), prompt, output

    def _reset_penalties(self, slots: np.ndarray, prompt: np.ndarray, output: np.ndarray) -> None:
        rows, width = prompt.shape
        reset = self.graphs.get(("reset", rows, width), functools.partial(self._lower_reset, rows, width))
        self.penalty = reset(self.penalty, slots, prompt, output)

    def prepare_inputs(self, rows: list[StepRow]) -> StepInputs:
        counts = [r.count for r in rows]
        token_ids = np.array([t for r in rows for t in r.seq.token_ids[r.start:r.start + r.count]], np.int32)
        slots = np.array([self.slot_of[r.seq.seq_id] for r in rows], np.int32)
        prompt = any(r.seq.params.prompt_logprobs is not None and r.start < r.seq.num_prompt_tokens for r in rows)
        return self.step_inputs(
            num_tokens=bucket_for(max(len(token_ids), len(rows), 1), self.token_buckets),   # forks: rows, no tokens
            num_seqs=bucket_for(len(rows), self.seq_buckets), **self.kv_addressing(slots),
            starts=[r.start for r in rows], counts=counts, token_ids=np.where(token_ids == PENDING, 0, token_ids),
            slots=slots, sample_mask=[r.samples for r in rows], params=[r.seq.params for r in rows],
            seeds=[r.seq.seed for r in rows], num_generated=[r.num_generated for r in rows],
            logits_from=[r.logits_from for r in rows], prev_index=self._prev_index(rows, counts, token_ids),
            next_prompt_ids=next_prompt_ids(rows, len(token_ids)) if prompt else None,
            num_logprobs=MAX_LOGPROBS if any(r.seq.params.logprobs for r in rows) else 0,
            sampler_mode=mode_for([r.seq.params for r in rows if r.samples], self.model_config.vocab_size))

    def _prev_index(self, rows: list[StepRow], counts: list[int], token_ids: np.ndarray) -> np.ndarray:
        """Per input token, the row of the previous step that sampled it while it is still on the device."""
        prev_index = np.full(len(token_ids), -1, np.int32)
        pending = np.flatnonzero(token_ids == PENDING)   # only a row's last token can still be pending
        owners = np.searchsorted(np.cumsum(counts), pending, side="right")
        prev_index[pending] = [self.prev_rows[rows[i].seq.seq_id] for i in owners]
        return prev_index


def _drop_vmm_cache(runner_ref: weakref.ref) -> None:
    """At exit: the arrays aliasing the VMM ranges go before the manager (else teardown order may segfault)."""
    if (runner := runner_ref()) is not None:
        runner.kv_cache = None
        runner.page_mapper.close()


def next_prompt_ids(rows: list[StepRow], num_tokens: int) -> np.ndarray:
    """Per input token, the prompt token after it (prompt logprobs); -1 past the prompt and for other rows."""
    ids, lo = np.full(num_tokens, -1, np.int32), 0
    for r in rows:
        if r.seq.params.prompt_logprobs is not None and r.start < r.seq.num_prompt_tokens:
            nxt = r.seq.token_ids[r.start + 1:min(r.start + r.count + 1, r.seq.num_prompt_tokens)]
            ids[lo:lo + len(nxt)] = nxt
        lo += r.count
    return ids
