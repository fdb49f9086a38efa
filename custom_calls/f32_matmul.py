"""y = x W on the CPU for a decode step's few rows of x, W f32 [in, out] as flax stores a linear's kernel, through
an XLA FFI custom call (`csrc/f32_matmul.cc`) that streams W's rows over XLA's intra-op threads, a slice of the
contraction each: XLA CPU's matrix-vector product reads such weights at 11-37 GB/s by shape, where two cores stream
~22. Elsewhere, or without the library, XLA's dot."""
import jax
import jax.numpy as jnp

from custom_calls.cpu import available

TARGET = "jaxserve_f32_matmul"
MAX_ROWS = 4   # rows of x the kernel takes: past a few, each weight read serves enough rows for XLA's GEMM


def f32_matmul_reference(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [M, in] . kernel [in, out] in f32 (XLA's dot)."""
    return jax.lax.dot_general(x, kernel, (((1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST)


def f32_matmul_unsupported(x, kernels) -> str | None:
    """Why the kernel cannot take x and these kernels (None when it can)."""
    if x.ndim != 2 or x.dtype != jnp.float32 or not 1 <= x.shape[0] <= MAX_ROWS:
        return f"x must be float32 [1 to {MAX_ROWS}, in], got {x.dtype} {x.shape}"
    for w in kernels:
        if w.ndim != 2 or w.dtype != jnp.float32 or w.shape[0] != x.shape[1]:
            return f"each kernel must be float32 [{x.shape[1]}, out], got {w.dtype} {w.shape}"
    return None


def f32_matmuls(x: jax.Array, kernels: list) -> list:
    """[x @ w for w in kernels] for kernels that read the same x (q, k and v; gate and up) in one call, their rows
    streamed once, where the CPU library runs (available()); the reference elsewhere. f32_matmul_unsupported names
    what the kernel does not take."""
    if why := f32_matmul_unsupported(x, kernels):
        raise ValueError(f"f32_matmuls: {why}")
    if not available():
        return [f32_matmul_reference(x, w) for w in kernels]
    outs = [jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w in kernels]
    return list(jax.ffi.ffi_call(TARGET, outs)(x, *kernels))
