"""Ragged paged attention: one call serves a mixed batch of chunked prefills and decodes.

Cache layout per layer: K and V each `[num_blocks, block_size, num_kv_heads, head_dim]`; block 0 is the
null block that padding writes land in.

Backends, per role. On Hopper (sm_90) "auto" runs the Mosaic GPU kernels wherever they serve the call, since
JAX 0.11 deprecated Pallas's Triton backend; Triton's kernels run there only when named (`prefill_backend` /
`decode_backend` "triton") or for calls Mosaic GPU's cannot serve (float32, head_dim 256). Off Hopper they are the
Pallas kernels.
- decode: `paged_decode_attention_mgpu` (Mosaic GPU: TMA page copies, wgmma, a persistent grid), or the Triton
  kernels below: decode has 1-8 query rows per KV head (Triton's mma pads them to 16 rows, Mosaic's wgmma to 64),
  each KV tile is gathered from pages at random addresses as one pointer-tensor load, and they run on sm_80+ with
  exact float32 dots and over fp8 caches.
- prefill: `paged_prefill_attention_mgpu` (Mosaic GPU: TMA page copies, wgmma, warp specialisation; bf16/f16 q),
  or the Triton prefill kernel below. A mixed call's leading decodes may be left to the caller's own kernel
  (`decode_rows`: the engine's CUDA call), the Mosaic prefill writing the other rows.
Nothing in the API names the backend (`prefill_backend` and `decode_backend` only override the choice). Under a JAX
that no longer ships Pallas's Triton backend (`TRITON`), the reference runs every launch Triton's kernels would have
run (`pallas_launches`), and "triton" is refused.

Two launches, with no host- or XLA-side metadata preparation (each program reads the raw
cu_q_lens/kv_lens/block_tables):
1. decode, grid (kv_heads, slots), for the leading run of q_len == 1 sequences (the engine orders
   decodes first): the slots are shared out among the actual decodes at run time, so a small batch
   splits each context over several programs (flash-decoding); each writes float32 partials and a
   log2-sum-exp.
2. prefill, grid (kv_heads, decode rows + q blocks). The first programs merge each decode's splits into
   its output row. The others own `block_q` tokens x the q heads of one KV head (GQA rows packed, so each
   KV tile is read once for the whole group) and mask only edge tiles. Sequence i's q blocks start at
   `cu_q_lens[i] // block_q + i` (vLLM's numbering); tokens past cu_q_lens[num_seqs] form one more
   sequence with no keys, so padding rows come out as zeros.
Fixed per-launch costs dominate small batches, hence the merge riding along.
With the Mosaic prefill, launch 2 is that kernel and a third, merge-only launch writes the decode rows into
its output in place; when the Mosaic decode kernel serves the call too (`decode_on_mosaic`), it writes them instead
and no Triton kernel runs (`mosaic_launches`).
A decode-only step does better when the caller knows it (`decode_only=True`, as the engine does): one launch.
Its split is fixed by the shape (the engine's bucket), so every program knows its decode and
tiles from its grid position and issues its first block-table and K/V loads before any length arrives
(`decode_only_kernel`); split programs count themselves done on an atomic counter and the last of each
decode merges the partials in the same launch. So a short context waits on two dependent loads, not on the
whole chain from num_seqs to K/V plus a merge launch.

Contiguous mode (vAttention, `contiguous_ragged_attention`): each sequence's KV is one row of the cache, which
viewed as blocks makes block i of row r the block r * blocks_per_row + i. The same launches run with
`kv_rows` [max_seqs] in place of the block table: each program loads its sequence's first block once and computes
every block id from it, so no table is built on the host, read, or gathered. A cross-layer cache (vAttention's
cache: a block holds every layer of its tokens, so that a 2 MiB page holds a short run of tokens, not 1,024
tokens of one layer) is the same cache viewed as [num_blocks * num_layers, block_size, ...]: layer l of block b
is block b * num_layers + l, so a row's blocks are num_layers apart (`Geometry.block_stride`). Only the
addressing differs (`BlockTable` / `SlotRows`, the kernels' `blocks`); the launches are the paged ones.

FP8 caches (float8_e4m3fn, same layout, a byte per element) are read as they are: the caller folds the K scale into
q and the V scale into the output, so the Triton kernels load e4m3 tiles and convert them exactly to the dots'
dtype: float16 under a bf16 or f16 q (e4m3 -> f16 is one instruction per pair on sm_89+; -> bf16 takes several
and bounds the loop; q, clipped to f16's range, loses none of bf16's 8 mantissa bits), float32 under an f32 q.
Triton converts e4m3 on sm_89+ only; "auto" takes the reference below that. The Mosaic prefill does not read them;
the Mosaic decode converts each tile to float16 in SMEM (taken when asked for: "auto" keeps Triton's measured path).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from custom_calls import paged_attention_cpu
from pallas_kernels.common import (FP8_CACHE, as_dot_dtype, exp2_shift, init_carry, interpret_params, log2_logits,
                                   normalize, online_softmax_step, per_row)
from pallas_kernels.block_tables import row_starts, strided_block_tables
from pallas_kernels.ragged_paged_attention_reference import FP8_BITS, ragged_paged_attention_reference

if TYPE_CHECKING:
    from pallas_kernels.paged_decode_attention_mgpu import DecodeTuning
    from pallas_kernels.paged_prefill_attention_mgpu import PrefillTuning

try:   # JAX 0.11 deprecated Pallas's Triton backend: under a JAX without it, Mosaic GPU or the reference serves
    from jax.experimental.pallas import triton as plgpu
except ImportError:
    plgpu = None
TRITON = plgpu is not None
NO_TRITON = "this JAX ships no Pallas Triton backend (deprecated since JAX 0.11)"

IMPLS = ("auto", "pallas", "cpu", "reference")
BACKENDS = ("auto", "triton", "mosaic")  # prefill_backend and decode_backend
INT32_MAX = 2**31 - 1
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # q's (and the output's), on the pallas impl
FP8_MIN_CAPABILITY = 8.9  # Triton converts e4m3 on sm_89+ (Ada, Hopper) only
PALLAS_MIN_CAPABILITY = 8.0


@dataclass(frozen=True, slots=True)
class Tuning:
    """Tile and launch shapes; defaults tuned on H100, bf16, head_dim 128."""
    decode_kv_tile: int = 64  # keys per loop step (rounded up to a whole page)
    decode_num_warps: int = 2  # light programs: several share an SM and hide each other's start-up
    decode_num_stages: int = 4
    decode_programs: int = 528  # ~4 programs per H100 SM: enough to split small batches, few empty ones
    decode_max_splits: int = 16
    split_decode_kv_tile: int = 32  # decode-only launch that splits: short per-program ranges pipeline better
    prefill_block_m: int = 64  # q rows per program: tokens x q heads of one KV head
    prefill_kv_tile: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 3
    cascade_programs: int = 264  # cascade's shared pass: kv heads x member tiles x splits of the shared keys
    mosaic_block_kv: int = 128  # keys per pipeline step of the Mosaic GPU prefill kernel
    mosaic_decode_block_kv: int = 64  # the Mosaic GPU decode kernel's keys per pipeline step
    mosaic_decode_steps: int = 4  # its pipeline steps in flight
    mosaic_decode_warpgroups: int = 1  # its compute warpgroups (2: alternate steps of an item; see FP8_TUNING)
    mosaic_decode_programs: int = 132  # work items its launch aims for (small batches split their contexts)


# float32 tiles are twice the bytes: halve them to stay inside shared memory. Chosen by the dots' dtype: an fp8
# cache's tiles are converted to it, so float32 q over an fp8 cache takes these too.
F32_TUNING = Tuning(decode_kv_tile=32, decode_num_warps=4, decode_num_stages=3, prefill_kv_tile=32,
                    prefill_num_stages=2)
# An fp8 cache under a 16-bit q: a tile is half the bytes, so decode keeps more of them in flight
# (benchmarks/attention.py --tune --kv-dtype fp8 on H100); the Mosaic GPU decode converts each tile, a chain two
# compute warpgroups overlap (1.19x at 256 x 512 on H200; over bf16 caches two were no faster, and 0.9x at 64 x 512).
FP8_TUNING = Tuning(decode_kv_tile=32, decode_num_stages=6, mosaic_decode_warpgroups=2)


@dataclass(frozen=True, slots=True)
class Geometry:
    """Static shapes every kernel closes over."""
    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    max_seqs: int
    max_blocks: int  # per sequence: the block table's width, or (contiguous) blocks_per_row
    contiguous: bool  # blocks are addressed by slot (SlotRows), not by table (BlockTable)
    block_stride: int = 1  # contiguous: ids between a row's consecutive blocks (a cross-layer cache's layers)

    @classmethod
    def of(cls, q, k_cache, blocks, blocks_per_row: int | None, block_stride: int = 1) -> "Geometry":
        """blocks: the block table (blocks_per_row None), or each sequence's first block."""
        contiguous = blocks_per_row is not None
        return cls(q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], blocks.shape[0],
                   blocks_per_row if contiguous else blocks.shape[1], contiguous, block_stride)

    def addressing(self, blocks_ref) -> "BlockTable | SlotRows":
        return SlotRows(blocks_ref) if self.contiguous else BlockTable(blocks_ref)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def group_pad(self) -> int:
        return pl.next_power_of_2(self.group)

    @property
    def decode_rows(self) -> int:
        """Decodes come first and have one token each: at most this many."""
        return min(self.max_seqs, self.num_tokens)


@dataclass(frozen=True, slots=True)
class Scores:
    """How logits are formed and masked."""
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None


@dataclass(frozen=True, slots=True)
class BlockTable:
    """Paged addressing: block i of sequence s is the host-built table's entry [s, i], gathered tile by tile."""
    ref: Any  # flat block tables [max_seqs * max_blocks]

    def of(self, seq, geo):
        return seq  # the table row: each tile loads its own entries

    def block(self, seq, col, masked, live, geo, num_pages):
        """Block ids of columns `col` (see attend_tile for `masked`)."""
        if masked == "speculative":  # unmasked: clamp the row read, and the ids, to real ones
            return jnp.clip(plgpu.load(self.ref.at[jnp.minimum(seq, geo.max_seqs - 1) * geo.max_blocks + col]),
                            0, num_pages - 1)
        return gather(self.ref.at[seq * geo.max_blocks + col], live if masked else None)  # garbage past kv_len


@dataclass(frozen=True, slots=True)
class SlotRows:
    """Contiguous addressing: sequence s's block i is first[s] + i * block_stride (first[s]: its row's first
    block, `row_starts`): one scalar load per program, then arithmetic; no table, no gather."""
    ref: Any  # first blocks [max_seqs]

    def of(self, seq, geo):
        return self.ref[jnp.minimum(seq, geo.max_seqs - 1)]

    def block(self, first, col, masked, live, geo, num_pages):
        return first + col * geo.block_stride if geo.block_stride > 1 else first + col


@dataclass(frozen=True, slots=True)
class PagedKV:
    """A layer's cache inside the Triton kernels: the addressing of its blocks, and K and V as rows
    [num_blocks * block_size * num_kv_heads, head_dim] (row (block * block_size + key) * kv_heads + kv head)."""
    blocks: BlockTable | SlotRows
    k: Any
    v: Any


def ragged_paged_attention(q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, num_seqs, *,
                           sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                           impl: str = "auto", prefill_backend: str = "auto", decode_backend: str = "auto",
                           decode_only: bool = False, interpret: bool = False, decode_rows=None,
                           **tuning) -> jax.Array:
    """Causal GQA attention of each sequence's new tokens over its paged KV (new tokens already cached).

    q [num_tokens, num_q_heads, head_dim]; cu_q_lens [max_seqs + 1]; kv_lens [max_seqs] (context including
    the new tokens); block_tables [max_seqs, max_blocks_per_seq]; num_seqs int32 [1] or scalar. Query j of
    sequence i sits at position kv_lens[i] - q_len_i + j. Rows past cu_q_lens[num_seqs] come out as zeros.
    The caches are q's dtype, or float8_e4m3fn (read as their values: any scale is the caller's); the output is q's.
    impl: "pallas" (the GPU kernel; `interpret=True` runs it on the CPU), "cpu" (the CPU custom call,
    `custom_calls.paged_attention_cpu`), "reference" (pure JAX), or "auto" (pallas on an sm_80+ NVIDIA GPU, sm_89+
    for an fp8 cache, or when interpreting; else cpu where it runs; else reference).
    prefill_backend, for the pallas impl's non-decode rows: "mosaic" (the Hopper wgmma/TMA kernel, q in
    bf16/f16), "triton", or "auto" (mosaic on sm_90 when it supports the call, else triton). decode_only: the
    caller guarantees every sequence has one query (token i is sequence i's; anything else is undefined), so the
    pallas impl runs one launch; decode_backend picks its kernel as prefill_backend does ("mosaic": the Hopper
    wgmma/TMA kernel, q in bf16/f16; "auto" takes it on sm_90 wherever it serves). decode_rows: where the Mosaic
    prefill serves a mixed call, a function (q's first rows [min(num_tokens, max_seqs), ...], the count of leading
    decodes int32 []) -> their outputs, zeros past that count, in place of this module's decode kernels.
    `tuning`: fields of `Tuning`.
    """
    return ragged_attention(q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, num_seqs, None,
                            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, impl=impl,
                            prefill_backend=prefill_backend, decode_backend=decode_backend, decode_only=decode_only,
                            interpret=interpret, decode_rows=decode_rows, **tuning)


def contiguous_ragged_attention(q, k_cache, v_cache, cu_q_lens, kv_lens, kv_rows, num_seqs, *, blocks_per_row: int,
                                sm_scale: float, num_layers: int = 1, layer=0, **options) -> jax.Array:
    """`ragged_paged_attention` on a contiguous (vAttention) cache: sequence i's KV is row kv_rows[i] of the cache,
    its first kv_lens[i] tokens, with no block table. The cache stays [num_blocks, block_size, kv_heads,
    head_dim], num_blocks = rows * blocks_per_row (a row's tokens are its blocks', in order); kv_rows int32
    [max_seqs], each < rows for live sequences (entries past num_seqs are ignored). A cross-layer cache
    ([rows * blocks_per_row, num_layers, block_size, ...] viewed as [.. * num_layers, block_size, ...]) is read at
    `layer` (an int or a traced int32 scalar). options: as `ragged_paged_attention`'s (sliding_window, soft_cap,
    impl, prefill_backend, decode_only, interpret, tuning).
    """
    check_layers(num_layers, layer)
    return ragged_attention(q, k_cache, v_cache, cu_q_lens, kv_lens,
                            row_starts(kv_rows, blocks_per_row, num_layers, layer), num_seqs, blocks_per_row,
                            sm_scale=sm_scale, block_stride=num_layers, **options)


def check_layers(num_layers: int, layer) -> None:
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    if isinstance(layer, int) and not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, num_layers={num_layers}), got {layer}")


def ragged_attention(q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, num_seqs, blocks_per_row: int | None, *,
                     sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                     impl: str = "auto", prefill_backend: str = "auto", decode_backend: str = "auto",
                     decode_only: bool = False, interpret: bool = False, block_stride: int = 1,
                     decode_rows=None, **tuning) -> jax.Array:
    """Both public entry points: `blocks` is the block table (blocks_per_row None) or each sequence's first block
    (contiguous, its row's blocks block_stride apart)."""
    num_seqs = check_inputs(q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, blocks_per_row, num_seqs,
                            sm_scale, sliding_window, soft_cap, impl, prefill_backend, block_stride, decode_backend)
    scores = Scores(float(sm_scale), sliding_window, None if soft_cap is None else float(soft_cap))
    impl = resolve_impl(impl, interpret, k_cache.dtype, q.shape[-1])
    if impl == "pallas":
        check_pallas_inputs(q, k_cache, interpret)
        out = pallas_launches(q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, num_seqs, scores=scores,
                              tuning=make_tuning(q.dtype, tuning, k_cache.dtype), prefill_backend=prefill_backend,
                              decode_backend=decode_backend, decode_only=decode_only, interpret=interpret,
                              decode_rows=decode_rows, blocks_per_row=blocks_per_row, block_stride=block_stride)
        if out is not None:
            return out
        impl = "reference"
    elif tuning:
        raise ValueError(f"tuning {sorted(tuning)} applies to impl='pallas' only")
    tables = blocks if blocks_per_row is None else strided_block_tables(blocks, blocks_per_row, block_stride)
    run = paged_attention_cpu.ragged_paged_attention_cpu if impl == "cpu" else ragged_paged_attention_reference
    return run(q, k_cache, v_cache, cu_q_lens, kv_lens, tables, num_seqs, **dataclasses.asdict(scores))


def pallas_launches(q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, num_seqs, *, scores: Scores, tuning: Tuning,
                    prefill_backend: str, decode_backend: str, decode_only: bool, interpret: bool,
                    decode_rows=None, **addressing) -> jax.Array | None:
    """The Pallas kernels' output; None where Triton's would serve and this JAX has none (the caller runs the
    reference), an error where a backend asks for Triton by name then."""
    args = (q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, num_seqs)
    rows = min(q.shape[0], blocks.shape[0])
    if decode_only:
        mosaic = decode_on_mosaic(q, k_cache, tuning, decode_backend, interpret)
        if mosaic is not None:
            run = mosaic_decode if interpret else pallas_mosaic_decode
            return run(q, k_cache, v_cache, kv_lens, blocks, num_seqs, scores=scores, tuning=mosaic,
                       interpret=interpret, **addressing)
        return one_launch_decode(*args, scores=scores, tuning=tuning, interpret=interpret, **addressing) \
            if triton_serves(decode_backend=decode_backend) else None
    mosaic = prefill_on_mosaic(q, k_cache, scores, tuning, prefill_backend, interpret)
    if mosaic is not None and decode_rows is not None:
        run = mosaic_prefill_rows if interpret else pallas_mosaic_prefill_rows
        out = run(*args, scores=scores, tuning=mosaic, interpret=interpret, **addressing)
        num_decodes = leading_decodes(cu_q_lens, num_seqs)
        return over_leading_rows(out, decode_rows(q[:rows], num_decodes), num_decodes)
    decode = None if mosaic is None else decode_on_mosaic(q, k_cache, tuning, decode_backend, interpret)
    if decode is not None:
        run = mosaic_launches if interpret else pallas_mosaic_attention
        return run(*args, scores=scores, prefill=mosaic, decode=decode, interpret=interpret, **addressing)
    if not triton_serves(prefill_backend=prefill_backend, decode_backend=decode_backend):
        return None
    run = attention_launches if mosaic is not None and interpret else pallas_attention
    return run(*args, scores=scores, tuning=tuning, interpret=interpret, mosaic=mosaic, **addressing)


def triton_in_auto(interpret: bool) -> bool:
    """Whether "auto" takes Triton's kernels where Mosaic GPU's could serve: not on Hopper (see the module), and only
    where this JAX ships the backend."""
    return TRITON and (interpret or gpu_capability() != 9.0)


def triton_serves(**backends: str) -> bool:
    """Whether Triton's kernels can run the launch the backends leave to them; an error where one names "triton"
    and this JAX has none."""
    if not TRITON and (asked := [name for name, backend in backends.items() if backend == "triton"]):
        raise ValueError(f"{asked[0]}='triton' but {NO_TRITON}: leave it 'auto'")
    return TRITON


def prefill_on_mosaic(q, k_cache, scores: Scores, tuning: Tuning, backend: str,
                      interpret: bool) -> PrefillTuning | None:
    """The Mosaic GPU prefill tuning when that kernel serves the prefill rows, else None (Triton does)."""
    mgpu_prefill = mosaic_prefill()
    prefill_tuning = mgpu_prefill.PrefillTuning(block_kv=tuning.mosaic_block_kv)
    why_not = mgpu_prefill.supported(q, k_cache, prefill_tuning)
    if backend == "mosaic" and why_not:
        raise ValueError(f"prefill_backend='mosaic' cannot serve this call: {why_not}; prefill_backend='triton' "
                         "(or 'auto', which falls back to it) can")
    if backend == "triton" or why_not:
        return None
    device = jax.devices()[0]
    if backend == "auto" and (interpret or getattr(device, "compute_capability", None) != "9.0"):   # see the module
        return None
    # one CTA per SM; the CPU interpreter (no core count) simulates a few, each taking several work items
    return dataclasses.replace(prefill_tuning, num_ctas=getattr(device, "core_count", None) or 4)


def decode_on_mosaic(q, k_cache, tuning: Tuning, backend: str, interpret: bool) -> DecodeTuning | None:
    """The Mosaic GPU decode tuning when that kernel serves a call's decodes, else
    None (Triton does)."""
    if backend == "triton":
        return None
    device = jax.devices()[0]
    if backend == "auto" and (interpret or getattr(device, "compute_capability", None) != "9.0"):   # see the module
        return None
    mgpu_decode = mosaic_decode_kernel()
    # one CTA per SM; the CPU interpreter (no core count) runs a few, each taking several work items
    decode_tuning = mgpu_decode.DecodeTuning(block_kv=tuning.mosaic_decode_block_kv,
                                             max_concurrent_steps=tuning.mosaic_decode_steps,
                                             compute_warpgroups=tuning.mosaic_decode_warpgroups,
                                             programs=tuning.mosaic_decode_programs,
                                             max_splits=tuning.decode_max_splits,
                                             num_ctas=getattr(device, "core_count", None) or 4)
    why_not = mgpu_decode.supported(q, k_cache, decode_tuning)
    if why_not and backend == "mosaic":
        raise ValueError(f"decode_backend='mosaic' cannot serve this call: {why_not}; decode_backend='triton' "
                         "(or 'auto', which falls back to it) can")
    return None if why_not else decode_tuning


def mosaic_decode(q, k_cache, v_cache, kv_lens, blocks, num_seqs, *, scores: Scores,
                  tuning: DecodeTuning, interpret: bool, blocks_per_row: int | None = None, block_stride: int = 1):
    return mosaic_decode_kernel().paged_decode_attention(
        q, k_cache, v_cache, kv_lens, blocks, jnp.asarray(num_seqs).reshape(()), sm_scale=scores.sm_scale,
        sliding_window=scores.sliding_window, soft_cap=scores.soft_cap, tuning=tuning, interpret=interpret,
        blocks_per_row=blocks_per_row, block_stride=block_stride)


def resolve_impl(impl: str, interpret: bool, cache_dtype=None, head_dim: int | None = None) -> str:
    """"auto": pallas where the kernels run (interpreted, or on a GPU that can read `cache_dtype`; without Triton's
    backend, Hopper's Mosaic GPU kernels only, not interpreted), else "cpu" where
    the CPU kernel serves this cache and head_dim, else reference. An fp8 cache kept as its bits (FP8_BITS) is read
    by the CPU kernel or the reference only."""
    bits = cache_dtype is not None and jnp.dtype(cache_dtype) == FP8_BITS
    if bits and impl == "pallas":
        raise ValueError("an fp8 cache kept as its bits (uint8) is read by impl='cpu' or 'reference' only; the Pallas "
                         "kernels take float8_e4m3fn caches")
    cpu_why_not = None if head_dim is None else paged_attention_cpu.unsupported(cache_dtype, head_dim)
    if impl == "cpu" and cpu_why_not:
        raise ValueError(f"impl='cpu' cannot serve this call: {cpu_why_not}; impl='auto' falls back to the reference")
    if impl != "auto":
        return impl
    capability = gpu_capability()
    # without Triton only Hopper has Pallas kernels (Mosaic GPU's), and the interpreter none under "auto"
    if not bits and (interpret or capability >= min_capability(cache_dtype)) and (
            TRITON or (capability == 9.0 and not interpret)):
        return "pallas"
    return "reference" if head_dim is None or cpu_why_not else "cpu"


def gpu_capability() -> float:
    """The first device's NVIDIA compute capability (9.0 on Hopper), 0 off NVIDIA GPUs."""
    device = jax.devices()[0]
    return float(getattr(device, "compute_capability", 0)) if device.platform == "gpu" else 0.0


def min_capability(cache_dtype) -> float:
    """The least compute capability whose Pallas kernels read a cache of `cache_dtype` (None: q's dtype)."""
    fp8 = cache_dtype is not None and jnp.dtype(cache_dtype) == FP8_CACHE
    return FP8_MIN_CAPABILITY if fp8 else PALLAS_MIN_CAPABILITY


def make_tuning(dtype, overrides: dict, cache_dtype=None) -> Tuning:
    fields = [f.name for f in dataclasses.fields(Tuning)]
    unknown = set(overrides) - set(fields)
    if unknown:
        raise ValueError(f"unknown tuning fields {sorted(unknown)}; valid: {fields}")
    compute = dot_dtype(dtype, cache_dtype)
    base = F32_TUNING if compute.itemsize == 4 else FP8_TUNING if compute != jnp.dtype(dtype) else Tuning()
    tuning = dataclasses.replace(base, **overrides)
    for name in ("decode_kv_tile", "split_decode_kv_tile", "prefill_block_m", "prefill_kv_tile"):
        if getattr(tuning, name) < 16 or not is_power_of_2(getattr(tuning, name)):
            raise ValueError(f"tuning {name}={getattr(tuning, name)} must be a power of two >= 16")
    return tuning


def dot_dtype(q_dtype, cache_dtype=None) -> jnp.dtype:
    """The dtype the kernels' dots take: q's, or float16 for a 16-bit q over an fp8 cache (see the module doc)."""
    fp8 = cache_dtype is not None and jnp.dtype(cache_dtype) == FP8_CACHE
    return jnp.dtype(jnp.float16 if fp8 and jnp.dtype(q_dtype).itemsize == 2 else q_dtype)


def load_q(q_ref, rows, ok, cache_dtype) -> jax.Array:
    """q's rows as the dots take them (dot_dtype), clipped to float16's range when converted to it."""
    q = load_tile_rows(q_ref, rows, ok)
    return as_dot_dtype(q, dot_dtype(q.dtype, cache_dtype))


def check_inputs(q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, blocks_per_row, num_seqs, sm_scale,
                 sliding_window, soft_cap, impl, prefill_backend, block_stride=1, decode_backend="auto"):
    """Validate shapes, dtypes and options; return num_seqs as int32 [1]."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if prefill_backend not in BACKENDS:
        raise ValueError(f"prefill_backend must be one of {BACKENDS}, got {prefill_backend!r}")
    if decode_backend not in BACKENDS:
        raise ValueError(f"decode_backend must be one of {BACKENDS}, got {decode_backend!r}")
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {k_cache.shape} and {v_cache.shape}")
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k_cache ({k_cache.shape[3]}) differ")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"num_q_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k_cache.shape[2]})")
    fp8_ok = k_cache.dtype in (FP8_CACHE, FP8_BITS) and q.dtype in KERNEL_DTYPES
    if v_cache.dtype != k_cache.dtype or not (k_cache.dtype == q.dtype or fp8_ok):
        raise ValueError(f"k_cache and v_cache must both have q's dtype, or both be float8_e4m3fn (or its bits, "
                         f"uint8) with q in float32/bfloat16/float16; got q {q.dtype}, k_cache {k_cache.dtype}, "
                         f"v_cache {v_cache.dtype}")
    if kv_lens.ndim != 1 or cu_q_lens.shape != (kv_lens.shape[0] + 1,):
        raise ValueError(f"kv_lens must be [max_seqs] and cu_q_lens [max_seqs + 1], got {kv_lens.shape}, "
                         f"{cu_q_lens.shape}")
    row_blocks = None if blocks_per_row is None else blocks_per_row * block_stride
    blocks_name = check_blocks(blocks, row_blocks, kv_lens, k_cache)
    for name, x in (("cu_q_lens", cu_q_lens), ("kv_lens", kv_lens), (blocks_name, blocks)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    num_seqs = jnp.asarray(num_seqs)
    if num_seqs.size != 1 or not jnp.issubdtype(num_seqs.dtype, jnp.integer):
        raise ValueError(f"num_seqs must be an integer scalar or [1] array, got {num_seqs.dtype}{num_seqs.shape}")
    if not isinstance(sm_scale, (int, float)) or not sm_scale > 0:
        raise ValueError(f"sm_scale must be a positive Python float, got {sm_scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if soft_cap is not None and (not isinstance(soft_cap, (int, float)) or not soft_cap > 0):
        raise ValueError(f"soft_cap must be None or a positive float, got {soft_cap!r}")
    return num_seqs.astype(jnp.int32).reshape(1)


def check_blocks(blocks, row_blocks, kv_lens, k_cache) -> str:
    """The block table [max_seqs, max_blocks], or kv_rows [max_seqs] over a cache of whole rows of row_blocks blocks
    (all layers'); returns its name."""
    if row_blocks is None:
        if blocks.ndim != 2 or blocks.shape[0] != kv_lens.shape[0]:
            raise ValueError(f"block_tables must be [max_seqs={kv_lens.shape[0]}, max_blocks_per_seq], "
                             f"got {blocks.shape}")
        return "block_tables"
    if not isinstance(row_blocks, int) or row_blocks < 1 or k_cache.shape[0] % row_blocks:
        raise ValueError(f"blocks_per_row (x num_layers) must be an int >= 1 dividing num_blocks={k_cache.shape[0]} "
                         f"(the cache is whole rows), got {row_blocks!r}")
    if blocks.shape != kv_lens.shape:
        raise ValueError(f"kv_rows must be [max_seqs={kv_lens.shape[0]}], got {blocks.shape}")
    return "kv_rows"


def check_pallas_inputs(q, k_cache, interpret: bool):
    head_dim, block_size = q.shape[2], k_cache.shape[1]
    if not is_power_of_2(head_dim) or head_dim < 16:
        raise ValueError(f"impl='pallas' needs head_dim a power of two >= 16, got {head_dim}")
    if not is_power_of_2(block_size):
        raise ValueError(f"impl='pallas' needs block_size a power of two, got {block_size}")
    if q.shape[1] // k_cache.shape[2] > 16:
        raise ValueError(f"impl='pallas' supports up to 16 q heads per kv head, got {q.shape[1] // k_cache.shape[2]}")
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"impl='pallas' needs q in float32/bfloat16/float16, got {q.dtype}")
    if not interpret and k_cache.dtype == FP8_CACHE and 0 < gpu_capability() < FP8_MIN_CAPABILITY:
        raise ValueError(f"impl='pallas' reads a float8_e4m3fn cache on compute capability {FP8_MIN_CAPABILITY}+ "
                         f"only (Triton's e4m3 conversion), this GPU is {gpu_capability()}; use impl='reference' "
                         "(or 'auto', which picks it here)")


def is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def mosaic_prefill():
    """The Mosaic GPU prefill kernel's module, imported on first use: Mosaic GPU's modules take ~0.5 s to import,
    which a start that never runs the kernel (every CPU start) need not pay."""
    from pallas_kernels import paged_prefill_attention_mgpu
    return paged_prefill_attention_mgpu


def mosaic_prefill_rows(q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, num_seqs, *, scores: Scores,
                        tuning: PrefillTuning, **addressing):
    """The Mosaic GPU prefill kernel's rows under the call's scores (decode rows left alone). addressing: interpret,
    blocks_per_row, block_stride."""
    return mosaic_prefill().paged_prefill_attention(q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, num_seqs,
                                                    sm_scale=scores.sm_scale, sliding_window=scores.sliding_window,
                                                    soft_cap=scores.soft_cap, tuning=tuning, **addressing)


def mosaic_launches(q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, num_seqs, *, scores: Scores,
                    prefill: PrefillTuning, decode: DecodeTuning, interpret: bool, blocks_per_row: int | None = None,
                    block_stride: int = 1):
    """A mixed batch on Mosaic GPU alone: the prefill kernel writes the prefill rows and zeros the padding tail,
    the decode kernel the leading decodes' rows (token i is decode i), written over the first rows."""
    addressing = dict(interpret=interpret, blocks_per_row=blocks_per_row, block_stride=block_stride)
    out = mosaic_prefill_rows(q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, num_seqs, scores=scores,
                              tuning=prefill, **addressing)
    rows = min(q.shape[0], blocks.shape[0])
    num_decodes = leading_decodes(cu_q_lens, num_seqs)
    decoded = mosaic_decode(q[:rows], k_cache, v_cache, kv_lens, blocks, num_decodes, scores=scores, tuning=decode,
                            **addressing)
    return over_leading_rows(out, decoded, num_decodes)


def over_leading_rows(out, decoded, num_decodes):
    """out with its first num_decodes rows taken from decoded [rows <= out's rows, ...]: one select over every row,
    not an update of the first rows, which XLA's GPU compiler refuses where the target is a custom call's output
    ("DUS target must be a fusion parameter")."""
    decoded = jnp.pad(decoded, ((0, out.shape[0] - decoded.shape[0]), (0, 0), (0, 0)))
    return jnp.where((jnp.arange(out.shape[0]) < num_decodes)[:, None, None], decoded, out)


# Mosaic GPU's launches run jitted, so that a step's identical calls (one a layer) lower once: its Python lowering
# takes ~0.5 s a kernel. The interpreter runs its warpgroups as threads that call back into XLA: under an outer jit
# they deadlock on the CPU client, so interpreted Mosaic calls run op by op.
pallas_mosaic_attention = jax.jit(mosaic_launches, static_argnames=("scores", "prefill", "decode", "interpret",
                                                                    "blocks_per_row", "block_stride"))
pallas_mosaic_decode = jax.jit(mosaic_decode, static_argnames=("scores", "tuning", "interpret", "blocks_per_row",
                                                               "block_stride"))
pallas_mosaic_prefill_rows = jax.jit(mosaic_prefill_rows, static_argnames=("scores", "tuning", "interpret",
                                                                           "blocks_per_row", "block_stride"))


def leading_decodes(cu_q_lens, num_seqs):
    """Length of the leading run of one-token sequences: sequence i is in it exactly when cu_q_lens[i + 1] == i + 1
    (every live sequence has a token)."""
    i = jnp.arange(cu_q_lens.shape[0] - 1)
    return jnp.sum((cu_q_lens[1:] == i + 1) & (i < jnp.asarray(num_seqs).reshape(())), dtype=jnp.int32)


def mosaic_decode_kernel():
    """The Mosaic GPU decode kernel's module, imported on first use (as `mosaic_prefill`)."""
    from pallas_kernels import paged_decode_attention_mgpu
    return paged_decode_attention_mgpu


def attention_launches(q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, num_seqs, *, scores: Scores,
                       tuning: Tuning, interpret: bool, mosaic: PrefillTuning | None,
                       blocks_per_row: int | None = None, block_stride: int = 1):
    geo = Geometry.of(q, k_cache, blocks, blocks_per_row, block_stride)
    meta = (num_seqs, cu_q_lens, kv_lens, blocks.reshape(-1))
    rows = (q.reshape(-1, geo.head_dim), k_cache.reshape(-1, geo.head_dim), v_cache.reshape(-1, geo.head_dim))
    parts, lse = decode_call(geo, scores, tuning, interpret)(*meta, *rows)
    if mosaic is None:
        out = prefill_call(geo, scores, tuning, interpret, q.dtype)(*meta, *rows, parts, lse)
        return out.reshape(q.shape)
    out = mosaic_prefill_rows(q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, num_seqs, scores=scores,
                              tuning=mosaic, interpret=interpret, blocks_per_row=blocks_per_row,
                              block_stride=block_stride)
    out = merge_call(geo, tuning, interpret, q.dtype)(num_seqs, cu_q_lens, parts, lse, out.reshape(-1, geo.head_dim))
    return out.reshape(q.shape)


pallas_attention = jax.jit(attention_launches,
                           static_argnames=("scores", "tuning", "interpret", "mosaic", "blocks_per_row",
                                            "block_stride"))


@functools.partial(jax.jit, static_argnames=("scores", "tuning", "interpret", "blocks_per_row", "block_stride"))
def one_launch_decode(q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, num_seqs, *, scores: Scores,
                      tuning: Tuning, interpret: bool, blocks_per_row: int | None = None, block_stride: int = 1,
                      prefix=None):
    """prefix (cascade attention): (kv_starts [S], partials [K * T * Hq, D] f32, their log2-sum-exp [K * T * Hq]),
    K splits of the shared keys: row i attends only keys [kv_starts[i], kv_len) and starts from its K partials
    merged where kv_starts[i] > 0."""
    geo = Geometry.of(q, k_cache, blocks, blocks_per_row, block_stride)
    splits = min(decode_slots(geo, tuning) // geo.decode_rows, tuning.decode_max_splits)  # fixed by the shape
    slots = max(geo.num_tokens, splits * geo.decode_rows)  # every token row has a program to zero it
    tile = tuning.split_decode_kv_tile if splits > 1 else tuning.decode_kv_tile
    kernel = functools.partial(decode_only_kernel, geo=geo, scores=scores, splits=splits,
                               tile=max(tile, geo.block_size), rows=max(16, geo.group_pad), interpret=interpret,
                               cascade=prefix is not None)
    out_shape = [jax.ShapeDtypeStruct((geo.num_tokens * geo.num_q_heads, geo.head_dim), q.dtype)]
    args = [num_seqs, kv_lens, blocks.reshape(-1), q.reshape(-1, geo.head_dim),
            k_cache.reshape(-1, geo.head_dim), v_cache.reshape(-1, geo.head_dim), *(prefix or ())]
    if splits > 1:  # float32 partials, their log2-sum-exp, and a zeroed done-counter per (kv head, decode)
        out_shape += [jax.ShapeDtypeStruct((slots * geo.num_q_heads, geo.head_dim), jnp.float32),
                      jax.ShapeDtypeStruct((slots * geo.num_q_heads,), jnp.float32),
                      jax.ShapeDtypeStruct((geo.num_kv_heads * geo.decode_rows,), jnp.int32)]
        args.append(jnp.zeros((geo.num_kv_heads * geo.decode_rows,), jnp.int32))
    out, *_ = pl.pallas_call(
        kernel, grid=(geo.num_kv_heads, slots), out_shape=out_shape,
        input_output_aliases={len(args) - 1: 3} if splits > 1 else {},
        compiler_params=plgpu.CompilerParams(num_warps=tuning.decode_num_warps,
                                             num_stages=tuning.decode_num_stages),
        interpret=interpret_params(interpret), name="ragged_paged_attention_decode_only",
    )(*args)
    return out.reshape(q.shape)


def decode_slots(geo: Geometry, tuning: Tuning) -> int:
    """Programs per KV head in the decode launch: one per possible decode, or more to fill the GPU."""
    return max(geo.decode_rows, pl.cdiv(tuning.decode_programs, geo.num_kv_heads))


def decode_call(geo: Geometry, scores: Scores, tuning: Tuning, interpret: bool):
    slots = decode_slots(geo, tuning)
    kernel = functools.partial(decode_kernel, geo=geo, scores=scores, slots=slots,
                               max_splits=tuning.decode_max_splits,
                               tile=max(tuning.decode_kv_tile, geo.block_size), rows=max(16, geo.group_pad))
    return pl.pallas_call(
        kernel, grid=(geo.num_kv_heads, slots),
        out_shape=(jax.ShapeDtypeStruct((slots * geo.num_q_heads, geo.head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((slots * geo.num_q_heads,), jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=tuning.decode_num_warps,
                                             num_stages=tuning.decode_num_stages),
        interpret=interpret_params(interpret), name="ragged_paged_attention_decode")


def prefill_call(geo: Geometry, scores: Scores, tuning: Tuning, interpret: bool, dtype):
    """Second launch: programs [0, decode_rows) merge the decode splits, the rest attend one q block each."""
    block_q = tuning.prefill_block_m // geo.group_pad
    num_blocks = geo.num_tokens // block_q + geo.max_seqs + 1  # bound: every sequence may end mid-block
    kernel = functools.partial(triton_prefill_kernel, geo=geo, scores=scores, block_q=block_q,
                               tile=max(tuning.prefill_kv_tile, geo.block_size), num_blocks=num_blocks,
                               slots=decode_slots(geo, tuning), max_splits=tuning.decode_max_splits)
    return pl.pallas_call(
        kernel, grid=(geo.num_kv_heads, geo.decode_rows + num_blocks),
        out_shape=jax.ShapeDtypeStruct((geo.num_tokens * geo.num_q_heads, geo.head_dim), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tuning.prefill_num_warps,
                                             num_stages=tuning.prefill_num_stages),
        interpret=interpret_params(interpret), name="ragged_paged_attention_prefill")


def merge_call(geo: Geometry, tuning: Tuning, interpret: bool, dtype):
    """Second launch beside the Mosaic prefill kernel: write the decode rows into its output, in place."""
    kernel = functools.partial(merge_kernel, geo=geo, slots=decode_slots(geo, tuning),
                               max_splits=tuning.decode_max_splits)
    return pl.pallas_call(
        kernel, grid=(geo.num_kv_heads, geo.decode_rows),
        out_shape=jax.ShapeDtypeStruct((geo.num_tokens * geo.num_q_heads, geo.head_dim), dtype),
        input_output_aliases={4: 0}, compiler_params=plgpu.CompilerParams(num_warps=tuning.prefill_num_warps),
        interpret=interpret_params(interpret), name="ragged_paged_attention_merge")


def merge_kernel(num_seqs_ref, cu_ref, parts_ref, lse_ref, _, o_ref, *, geo, slots, max_splits):
    combine_splits(parts_ref, lse_ref, o_ref, cu_ref, num_seqs_ref[0], pl.program_id(0), pl.program_id(1), geo,
                   slots, max_splits)


def triton_prefill_kernel(num_seqs_ref, cu_ref, kv_lens_ref, blocks_ref, q_ref, k_ref, v_ref, parts_ref, lse_ref,
                          o_ref, *, geo, scores, block_q, tile, num_blocks, slots, max_splits):
    kv_head, pid = pl.program_id(0), pl.program_id(1)
    num_seqs = num_seqs_ref[0]

    @pl.when(pid < geo.decode_rows)
    def _():
        combine_splits(parts_ref, lse_ref, o_ref, cu_ref, num_seqs, kv_head, pid, geo, slots, max_splits)

    @pl.when(pid >= geo.decode_rows)
    def _():  # the last (longest causal) blocks first
        cache = PagedKV(geo.addressing(blocks_ref), k_ref, v_ref)
        attend_block(cu_ref, kv_lens_ref, q_ref, o_ref, cache, num_seqs, kv_head,
                     num_blocks - 1 - (pid - geo.decode_rows), geo, scores, block_q, tile)


def attend_block(cu_ref, kv_lens_ref, q_ref, o_ref, cache: PagedKV, num_seqs, kv_head, block, geo, scores, block_q,
                 tile):
    """Prefill role: `block_q` tokens x the q heads of one KV head; zeros for padding tokens."""
    seq, q_start, q_len, t0 = locate_block(cu_ref, num_seqs, block, geo, block_q)
    is_decode = (seq < num_seqs) & (q_start + q_len == seq + 1)  # in the leading q_len == 1 run
    active = (seq <= num_seqs) & ~is_decode & (t0 < q_len)
    kv_len = jnp.where(seq < num_seqs, kv_lens_ref[jnp.minimum(seq, geo.max_seqs - 1)], 0)
    r = jnp.arange(block_q * geo.group_pad)
    token, head = t0 + r // geo.group_pad, r % geo.group_pad
    row_ok = active & (token < q_len) & (head < geo.group)
    q_row = (q_start + token) * geo.num_q_heads + kv_head * geo.group + head
    q = load_q(q_ref, q_row, row_ok, cache.k.dtype)
    oldest = kv_len - q_len + t0
    newest = kv_len - q_len + jnp.minimum(t0 + block_q, q_len) - 1
    t_hi = pl.cdiv(jnp.where(active, jnp.maximum(newest + 1, 0), 0), tile)
    t_lo, full_lo = 0, 0
    if scores.sliding_window is not None:
        t_lo = jnp.minimum(jnp.maximum(oldest - scores.sliding_window + 1, 0) // tile, t_hi)
        full_lo = pl.cdiv(jnp.maximum(newest - scores.sliding_window + 1, 0), tile)
    step = functools.partial(attend_tile, q=q, q_pos=kv_len - q_len + token, seq_blocks=cache.blocks.of(seq, geo),
                             kv_len=kv_len,
                             kv_head=kv_head, cache=cache, geo=geo, scores=scores, tile=tile)
    acc, _, l = attend_range(init_carry(q.shape), t_lo, t_hi, full_lo, jnp.maximum(oldest + 1, 0) // tile, step)
    store_tile_rows(o_ref, q_row, row_ok, normalize(acc, l).astype(o_ref.dtype))


def combine_splits(parts_ref, lse_ref, o_ref, cu_ref, num_seqs, kv_head, seq, geo, slots, max_splits):
    """Combine role: merge decode `seq`'s split partials for the q heads of one KV head into its output row."""
    num_decodes = count_decodes(cu_ref, num_seqs, geo)
    splits = decode_splits(num_decodes, slots, max_splits)
    r = jnp.arange(geo.group_pad)
    head = kv_head * geo.group + r
    ok = (seq < num_decodes) & (r < geo.group)

    def merge(split, carry):
        acc, m, l = carry
        row = (seq * splits + split) * geo.num_q_heads + head
        lse = load_lse(lse_ref, row, ok)
        m_new = jnp.maximum(m, lse)
        shift = exp2_shift(m_new)
        alpha, weight = jnp.exp2(m - shift), jnp.exp2(lse - shift)
        acc = acc * per_row(alpha, acc.shape) + per_row(weight, acc.shape) * load_tile_rows(parts_ref, row, ok)
        return acc, m_new, l * alpha + weight

    carry = init_carry((geo.group_pad, geo.head_dim))
    acc, _, l = lax.fori_loop(0, jnp.where(seq < num_decodes, splits, 0), merge, carry)
    store_tile_rows(o_ref, seq * geo.num_q_heads + head, ok, normalize(acc, l).astype(o_ref.dtype))


def locate_block(cu_ref, num_seqs, block, geo, block_q):
    """(sequence, its first token, its q_len, block's first token within it) for q block `block`."""
    i = jnp.arange(pl.next_power_of_2(geo.max_seqs + 2))
    start = plgpu.load(cu_ref.at[jnp.minimum(i, geo.max_seqs)], mask=i <= num_seqs, other=geo.num_tokens)
    first_block = jnp.where(i <= num_seqs + 1, start // block_q + i, INT32_MAX)
    seq = jnp.sum((first_block <= block).astype(jnp.int32)) - 1
    q_start = jnp.sum(jnp.where(i == seq, start, 0))
    q_len = jnp.sum(jnp.where(i == seq + 1, start, 0)) - q_start
    return seq, q_start, q_len, (block - jnp.sum(jnp.where(i == seq, first_block, 0))) * block_q


def decode_kernel(num_seqs_ref, cu_ref, kv_lens_ref, blocks_ref, q_ref, k_ref, v_ref, parts_ref, lse_ref, *, geo,
                  scores, slots, max_splits, tile, rows):
    """Mixed batch, decode role: one split of a decode (the slots are shared out among the decodes at run
    time), float32 partials and log2-sum-exp; the prefill (or merge) launch merges them."""
    kv_head, slot = pl.program_id(0), pl.program_id(1)
    num_decodes = count_decodes(cu_ref, num_seqs_ref[0], geo)
    splits = decode_splits(num_decodes, slots, max_splits)
    seq, split = slot // splits, slot % splits
    active = seq < num_decodes
    kv_len = jnp.where(active, kv_lens_ref[jnp.minimum(seq, geo.max_seqs - 1)], 0)
    r = jnp.arange(rows)
    head = kv_head * geo.group + r
    row_ok = active & (r < geo.group)
    q = load_q(q_ref, seq * geo.num_q_heads + head, row_ok, k_ref.dtype)  # decode i is token i
    first = 0 if scores.sliding_window is None else jnp.maximum(kv_len - scores.sliding_window, 0)
    t_lo, t_hi = first // tile, pl.cdiv(kv_len, tile)
    per_split = pl.cdiv(t_hi - t_lo, splits)
    lo = jnp.minimum(t_lo + split * per_split, t_hi)
    cache = PagedKV(geo.addressing(blocks_ref), k_ref, v_ref)
    step = functools.partial(attend_tile, q=q, q_pos=jnp.full((rows,), kv_len - 1),
                             seq_blocks=cache.blocks.of(seq, geo), kv_len=kv_len, kv_head=kv_head, cache=cache,
                             geo=geo, scores=scores, tile=tile)
    acc, m, l = attend_range(init_carry(q.shape), lo, jnp.minimum(lo + per_split, t_hi), pl.cdiv(first, tile),
                             kv_len // tile, step)
    store_partials(parts_ref, lse_ref, slot * geo.num_q_heads + head, row_ok, acc, m, l)


def decode_only_kernel(num_seqs_ref, kv_lens_ref, blocks_ref, q_ref, k_ref, v_ref, *refs, geo, scores, splits, tile,
                       rows, interpret, cascade):
    """Decode-only batch (token i is decode i), one launch. Program (kv head, slot) attends tiles
    split, split + splits, ... of decode slot // splits, `splits` fixed by the shape. Nothing it loads first
    waits for another load: without a window its first tile's block ids (table entries) and
    K/V are fetched before the context length arrives (clamped to a real page, masked after), so a short context
    costs two dependent loads. Split programs write partials and count themselves done on an atomic
    counter; the last one of a decode merges them. Programs past the decodes zero their token's rows. Contiguous
    rows are not read speculatively (see below). cascade: a row with kv_starts > 0 attends keys [kv_starts, kv_len)
    from its shared-prefix partials (the first split carries them in, merged; the merge weighs it like any split)."""
    starts_ref, prefix_parts_ref, prefix_lse_ref = refs[:3] if cascade else (None,) * 3
    refs = refs[3:] if cascade else refs
    if splits > 1:  # the zeroed done-counters come in first, aliased to count_ref
        _, out_ref, parts_ref, lse_ref, count_ref = refs
    else:
        (out_ref,) = refs
    kv_head, slot = pl.program_id(0), pl.program_id(1)
    seq, split = slot // splits, slot % splits
    num_decodes = num_seqs_ref[0]
    active = seq < num_decodes
    kv_len = jnp.where(active, kv_lens_ref[jnp.minimum(seq, geo.max_seqs - 1)], 0)
    r = jnp.arange(rows)
    head = kv_head * geo.group + r
    q = load_q(q_ref, jnp.minimum(seq, geo.num_tokens - 1) * geo.num_q_heads + head, r < geo.group, k_ref.dtype)
    first = 0 if scores.sliding_window is None else jnp.maximum(kv_len - scores.sliding_window, 0)
    carry = init_carry(q.shape)
    if cascade:
        first = jnp.where(active, starts_ref[jnp.minimum(seq, geo.max_seqs - 1)], 0)
        shared = active & (first > 0) & (split == 0) & (r < geo.group)
        carry = prefix_carry(prefix_parts_ref, prefix_lse_ref, seq * geo.num_q_heads + head, shared, geo)
    t0 = first // tile + split  # this program's tiles: t0, t0 + splits, ...
    cache = PagedKV(geo.addressing(blocks_ref), k_ref, v_ref)
    step = functools.partial(strided_tile, t0=t0, splits=splits, q=q, q_pos=jnp.full((rows,), kv_len - 1),
                             seq_blocks=cache.blocks.of(seq, geo), kv_len=kv_len, kv_head=kv_head, cache=cache, geo=geo,
                             scores=scores, tile=tile, kv_start=first if cascade else None)
    # Contiguous rows load nothing past kv_len: a vattention row's pages past its tokens may be unmapped (a 2 MiB
    # page holds only 32 tokens of a cross-layer cache), so their first tile waits for the length.
    carry = step(0, carry, masked=True if geo.contiguous else "speculative")
    n = pl.cdiv(jnp.maximum(pl.cdiv(kv_len, tile) - t0, 0), splits)
    full_lo, full_hi = (pl.cdiv(jnp.maximum(t - t0, 0), splits) for t in (pl.cdiv(first, tile), kv_len // tile))
    acc, m, l = attend_range(carry, 1, n, full_lo, full_hi, step)
    row_ok = active & (r < geo.group)
    out_rows = slot * geo.num_q_heads + head
    pad = (slot >= num_decodes) & (slot < geo.num_tokens)
    store_tile_rows(out_ref, out_rows, pad & (r < geo.group), jnp.zeros((rows, geo.head_dim), out_ref.dtype))
    if splits == 1:
        store_tile_rows(out_ref, out_rows, row_ok, normalize(acc, l).astype(out_ref.dtype))
        return
    store_partials(parts_ref, lse_ref, out_rows, row_ok, acc, m, l)

    @pl.when(active)
    def _():
        if not interpret:  # every thread's partials are stored before the counter says so (the interpreter
            plgpu.debug_barrier()  # runs programs one at a time)
        done = plgpu.atomic_add(count_ref, kv_head * geo.decode_rows + seq, jnp.int32(1))  # acq_rel, GPU scope
        pl.when(done == splits - 1)(lambda: merge_splits(parts_ref, lse_ref, out_ref, seq, splits, head,
                                                         r < geo.group, geo))


def prefix_carry(parts_ref, lse_ref, rows, ok, geo):
    """The online-softmax state (acc, m, l) of the shared pass's partials of `rows` (one per shared split, the
    buffers' leading dimension); the empty state where not `ok`."""
    per_split = geo.num_tokens * geo.num_q_heads
    return merge_partials(parts_ref, lse_ref, [k * per_split + rows for k in range(lse_ref.shape[0] // per_split)],
                          ok)


def strided_tile(i, carry, *, masked, t0, splits, **tile_args):
    """attend_tile on this program's i-th tile, t0 + i * splits."""
    return attend_tile(t0 + i * splits, carry, masked=masked, **tile_args)


def merge_splits(parts_ref, lse_ref, out_ref, seq, splits, head, ok, geo):
    """Merge a decode's `splits` partials (other programs of this launch wrote them: volatile loads, since L1 is
    not coherent) into its output rows."""
    rows = [(seq * splits + i) * geo.num_q_heads + head for i in range(splits)]
    acc, _, l = merge_partials(parts_ref, lse_ref, rows, ok, volatile=True)
    store_tile_rows(out_ref, seq * geo.num_q_heads + head, ok, normalize(acc, l).astype(out_ref.dtype))


def merge_partials(parts_ref, lse_ref, rows, ok, volatile=False):
    """(acc, m, l): the online-softmax state of the partials at each of `rows` (a list: all loads issued at once)
    weighed by their log2-sum-exps; rows with no keys anywhere (all -inf) come out as the empty state."""
    lse = [load_lse(lse_ref, row, ok, volatile) for row in rows]
    parts = [load_tile_rows(parts_ref, row, ok, volatile) for row in rows]
    m = functools.reduce(jnp.maximum, lse)
    weights = [jnp.exp2(x - exp2_shift(m)) for x in lse]
    acc = functools.reduce(jnp.add, [per_row(w, p.shape) * p for w, p in zip(weights, parts)])
    return acc, m, functools.reduce(jnp.add, weights)


def store_partials(parts_ref, lse_ref, rows, ok, acc, m, l):
    """One split's share of a decode: its normalised float32 rows and their log2-sum-exp, the merge's weight."""
    store_tile_rows(parts_ref, rows, ok, normalize(acc, l))
    plgpu.store(lse_ref.at[jnp.where(ok, rows, lse_ref.shape[0])], m + jnp.log2(l), mask=ok)


def load_lse(lse_ref, rows, ok, volatile=False):
    """The log2-sum-exps `store_partials` wrote; -inf (weight 0) where not `ok`."""
    return plgpu.load(lse_ref.at[jnp.where(ok, rows, 0)], mask=ok, other=-jnp.inf, volatile=volatile)


def count_decodes(cu_ref, num_seqs, geo):
    """Length of the leading run of q_len == 1 sequences: exactly where cu_q_lens[i + 1] == i + 1."""
    i = jnp.arange(pl.next_power_of_2(geo.max_seqs))
    ends = plgpu.load(cu_ref.at[jnp.minimum(i + 1, geo.max_seqs)], mask=i < num_seqs, other=-1)
    return jnp.sum((ends == i + 1).astype(jnp.int32))


def decode_splits(num_decodes, slots, max_splits):
    """Programs per decode (per KV head): the slots shared out evenly, at most max_splits."""
    return jnp.clip(slots // jnp.maximum(num_decodes, 1), 1, max_splits)


def attend_range(carry, lo, hi, full_lo, full_hi, step):
    """Run `step` over tiles [lo, hi), masking only tiles outside [full_lo, full_hi)."""
    a = jnp.clip(full_lo, lo, hi)
    b = jnp.clip(full_hi, a, hi)
    carry = lax.fori_loop(lo, a, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(a, b, functools.partial(step, masked=False), carry)
    return lax.fori_loop(b, hi, functools.partial(step, masked=True), carry)


def attend_tile(t, carry, *, masked, q, q_pos, seq_blocks, kv_len, kv_head, cache: PagedKV, geo, scores, tile,
                kv_start=None):
    """Online-softmax update with keys [t * tile, (t + 1) * tile), gathered page by page (seq_blocks: the
    sequence as `cache.blocks.of` gives it). masked: False (all keys visible), True, or "speculative": the loads
    do not wait for kv_len (pages read are clamped to real ones; keys past kv_len are masked and their V rows
    zeroed, since 0 x NaN would leak). kv_start: keys before it are masked too (cascade attention's own keys)."""
    key = t * tile + jnp.arange(tile)
    live = key < kv_len
    col = jnp.minimum(key // geo.block_size, geo.max_blocks - 1)
    num_pages = cache.k.shape[0] // (geo.block_size * geo.num_kv_heads)
    page = cache.blocks.block(seq_blocks, col, masked, live, geo, num_pages)
    kv_row = (page * geo.block_size + key % geo.block_size) * geo.num_kv_heads + kv_head
    mask = live if masked is True else None
    # An fp8 cache's tiles become the dots' dtype (q's, see load_q) exactly as they load
    s = logits(q, load_tile_rows(cache.k, kv_row, mask).astype(q.dtype), scores)
    if masked:
        seen = visible(key, q_pos, scores.sliding_window)
        s = jnp.where(seen if kv_start is None else seen & (key >= kv_start)[None, :], s, -jnp.inf)
    acc, m, l = carry
    m_new, p, alpha = online_softmax_step(m, s)
    # issued before the row sums: latency decides small decodes
    v = load_tile_rows(cache.v, kv_row, mask).astype(q.dtype)
    keep = live if masked == "speculative" else None
    # a row's table need not hold the keys before kv_start (cascade attention's shared pass reads them)
    if masked and kv_start is not None:
        keep = key >= kv_start if keep is None else keep & (key >= kv_start)
    if keep is not None:
        v = jnp.where(keep[:, None], v, jnp.zeros((), v.dtype))
    pv = dot(p.astype(v.dtype), v, ((1,), (0,)))
    return acc * per_row(alpha, acc.shape) + pv, m_new, l * alpha + p.sum(axis=1)


def logits(q, k, scores: Scores):
    """q @ k.T in float32, scaled (and soft-capped) into the log2 domain that exp2 wants."""
    return log2_logits(dot(q, k, ((1,), (1,))), scores.sm_scale, scores.soft_cap)


def dot(a, b, dims):
    """float32-accumulated dot; HIGHEST keeps float32 operands exact (Triton's DEFAULT means TF32)."""
    return lax.dot_general(a, b, (dims, ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def visible(key, q_pos, sliding_window):
    """Causal mask [rows, keys], and the Mistral window: key > q_pos - window."""
    ok = key[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        ok &= key[None, :] > q_pos[:, None] - sliding_window
    return ok


def gather(ref_view, mask):
    return plgpu.load(ref_view) if mask is None else plgpu.load(ref_view, mask=mask, other=0)


def load_tile_rows(ref, rows, ok, volatile=False):
    """ref[rows, :] as a tile; rows where `ok` is False (None: all valid) read as 0."""
    view = ref.at[rows[:, None], jnp.arange(ref.shape[1])[None, :]]
    if ok is None:
        return plgpu.load(view, volatile=volatile)
    # the fill in ref's dtype: Triton's lowering casts no integer to float8
    return plgpu.load(view, mask=jnp.broadcast_to(ok[:, None], (rows.shape[0], ref.shape[1])),
                      other=jnp.zeros((), ref.dtype), volatile=volatile)


def store_tile_rows(ref, rows, ok, tile):
    """ref[rows, :] = tile where `ok`; skipped rows point past the end so the interpreter drops them too."""
    rows = jnp.where(ok, rows, ref.shape[0])
    plgpu.store(ref.at[rows[:, None], jnp.arange(tile.shape[1])[None, :]], tile,
                mask=jnp.broadcast_to(ok[:, None], tile.shape))
