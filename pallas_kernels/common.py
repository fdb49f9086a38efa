"""What the Pallas kernels here share: how each backend is told to run interpreted on the CPU, and the online
softmax's arithmetic.

The softmax works in the log2 domain (logits come scaled by LOG2E, so exp2 stands in for exp) on float32
carries (acc [rows, head_dim], m and l [rows]). Per-row vectors reach tiles through `lax.broadcast_in_dim`,
the form the Mosaic GPU kernel's register layouts take and the Triton lowering takes too.
"""
import math

import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
FP8_CACHE = jnp.dtype(jnp.float8_e4m3fn)  # the one cache dtype that may differ from q's
F16_MAX = float(jnp.finfo(jnp.float16).max)


def as_dot_dtype(q, dtype):
    """q in the dots' dtype: as it is, or float16 (over an fp8 cache) clipped to its range, in float32: bf16 rounds
    F16_MAX up to 65536, which float16 holds as inf."""
    if q.dtype == dtype:
        return q
    return jnp.clip(q.astype(jnp.float32), -F16_MAX, F16_MAX).astype(dtype)


def interpret_params(interpret: bool) -> bool:
    """Triton backend, `pallas_call(interpret=...)`: run on the CPU through the HLO interpreter when asked."""
    return bool(interpret)


def mosaic_interpret_params(interpret: bool):
    """Mosaic GPU backend, `plgpu.kernel(interpret=...)`: its warpgroup-level interpreter when asked, else None
    (compile for the GPU). Imported here: Mosaic GPU's modules take ~0.5 s to import, which a start that runs no
    Mosaic GPU kernel (every CPU start) need not pay."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.InterpretGPUParams() if interpret else None


def init_carry(shape):
    """(acc, m, l) of an online softmax over no keys yet, for `shape` = [rows, head_dim]."""
    rows = shape[:1]
    return jnp.zeros(shape, jnp.float32), jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32)


def log2_logits(s, sm_scale: float, soft_cap: float | None):
    """Raw scores q . k (float32) scaled, and soft-capped (tanh) where asked, into the log2 domain exp2 wants."""
    if soft_cap is None:
        return s * (sm_scale * LOG2E)
    return jnp.tanh(s * (sm_scale / soft_cap)) * (soft_cap * LOG2E)


def exp2_shift(m):
    """The row max to subtract before exp2: m, except 0 on rows that have seen no key (m = -inf), so that exp2
    gives those rows 0 instead of NaN."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def online_softmax_step(m, logits, *, rows_see_keys=False):
    """One tile of log2-domain logits [rows, keys] against the running row max m.

    Returns (m, p, alpha): the new max, the tile's unnormalised probabilities p [rows, keys], and alpha [rows],
    which rescales the sums so far: acc * alpha + p @ v and l * alpha + sum(p). Those stay with the caller, to
    place among its loads and barriers. rows_see_keys: every row has seen a key by now (its max is finite), so
    the guard against -inf - -inf is left out.
    """
    m_new = jnp.maximum(m, logits.max(axis=1))
    shift = m_new if rows_see_keys else exp2_shift(m_new)
    return m_new, jnp.exp2(logits - per_row(shift, logits.shape)), jnp.exp2(m - shift)


def merge_carries(a, b):
    """Two carries (acc, m, l) over disjoint keys as one: each weighed by exp2(its max - the max)."""
    (acc_a, m_a, l_a), (acc_b, m_b, l_b) = a, b
    m = jnp.maximum(m_a, m_b)
    shift = exp2_shift(m)
    alpha_a, alpha_b = jnp.exp2(m_a - shift), jnp.exp2(m_b - shift)
    return (acc_a * per_row(alpha_a, acc_a.shape) + acc_b * per_row(alpha_b, acc_b.shape), m,
            l_a * alpha_a + l_b * alpha_b)


def normalize(acc, l):
    """acc / l row by row; rows that saw no key (l == 0) come out as zeros."""
    return acc / per_row(jnp.where(l == 0, 1.0, l), acc.shape)


def per_row(x, shape):
    """Row vector x [rows] broadcast across a tile of `shape` [rows, n]."""
    return lax.broadcast_in_dim(x, shape, [0])
