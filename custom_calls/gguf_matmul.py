"""y = x W^T with W in a GGUF block format (Q4_1, Q8_0: llama.cpp's layouts, kept as the file stores them), on the
CPU through an XLA FFI custom call (`csrc/gguf_matmul.cc`, AVX2) that widens each block in registers: a CPU decode
step reads 5.0 or 8.5 bits a weight instead of f32's 32. Elsewhere, or without the library, the pure-JAX reference
dequantizes the blocks and runs XLA's dot.

Blocks of 32 weights along a row (the contraction), each row [in / 32 * bytes] uint8:
- Q4_1 (20 bytes): f16 scale d, f16 offset m, 16 bytes of 4-bit q (q[j] in the low nibbles, q[j + 16] in the high
  ones); w = d * q + m.
- Q8_0 (34 bytes): f16 scale d, 32 signed bytes q; w = d * q.
"""
import jax
import jax.numpy as jnp
import numpy as np

from custom_calls.cpu import available

TARGET, DEQUANTIZE_TARGET = "jaxserve_gguf_matmul", "jaxserve_gguf_dequantize"
BLOCK = 32
# name -> (GGML type id, bytes a block)
BLOCK_TYPES = {"Q4_1": (3, 20), "Q8_0": (8, 34)}
# The kernel widens every block once per 4 rows of x, so its time grows with the rows; XLA's GEMM of the weights
# dequantized whole pays the dequantization once. 1536 x 576 Q4_1 on two AVX2 cores, kernel against dequantization
# + GEMM: 0.55 / 1.25 ms at 16 rows, 2.2 / 2.0 ms at 64, 9.9 / 4.6 ms at 256. Steps up to the crossover take the
# kernel, larger prefill chunks the library's dequantization (the reference's in XLA runs as fast, but its fusions
# compile slowly: a cold start of the embedded model took 129 s with it past 32 rows, 105 s for the f32 model).
KERNEL_MAX_ROWS = 64


def row_bytes(block_type: str, in_features: int) -> int:
    if in_features % BLOCK:
        raise ValueError(f"{block_type} weights need in_features a multiple of {BLOCK}, got {in_features}")
    return in_features // BLOCK * BLOCK_TYPES[block_type][1]


def dequantize(blocks: jax.Array, block_type: str) -> jax.Array:
    """uint8 [..., in / 32 * bytes] -> f32 [..., in]."""
    size = BLOCK_TYPES[block_type][1]
    b = blocks.reshape(*blocks.shape[:-1], -1, size)
    half = lambda lo: jax.lax.bitcast_convert_type(b[..., lo:lo + 2], jnp.float16).astype(jnp.float32)  # noqa: E731
    if block_type == "Q4_1":
        nibbles = b[..., 4:]
        q = jnp.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(jnp.float32)
        w = q * half(0)[..., None] + half(2)[..., None]
    else:
        w = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32) * half(0)[..., None]
    return w.reshape(*blocks.shape[:-1], -1)


def gguf_matmul_reference(x: jax.Array, blocks: jax.Array, block_type: str) -> jax.Array:
    """x [M, in] . dequantize(blocks [out, ...])^T -> f32 [M, out]."""
    w = dequantize(blocks, block_type)
    return jax.lax.dot_general(x.astype(jnp.float32), w, (((1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)


def check_args(x, blocks, block_type: str) -> None:
    if block_type not in BLOCK_TYPES:
        raise ValueError(f"block_type {block_type!r} is not one of {', '.join(BLOCK_TYPES)}")
    if x.ndim != 2 or blocks.ndim != 2 or blocks.dtype != jnp.uint8:
        raise ValueError(f"need x [M, in] and uint8 blocks [out, in / 32 * bytes], got x {x.shape} and "
                         f"{blocks.dtype} blocks {blocks.shape}")
    if blocks.shape[1] != row_bytes(block_type, x.shape[1]):
        raise ValueError(f"{block_type} blocks of {blocks.shape[1]} bytes a row do not cover x's {x.shape[1]} "
                         f"inputs ({row_bytes(block_type, x.shape[1])} bytes)")


def gguf_matmul(x: jax.Array, blocks: jax.Array, block_type: str) -> jax.Array:
    """x [M, in] (any float dtype) . W^T -> f32 [M, out], W as `blocks` [out, in / 32 * bytes] hold it: where the
    CPU library runs (available()), its kernel up to KERNEL_MAX_ROWS rows and XLA's GEMM of its dequantization past
    them; elsewhere the reference."""
    return gguf_matmuls(x, [blocks], block_type)[0]


def gguf_matmuls(x: jax.Array, weights: list, block_type: str) -> list:
    """[gguf_matmul(x, blocks, block_type) for blocks in weights]: the kernel's rows of all of them in one call (q, k
    and v; gate and up), so small matrices share its hand-offs to the threads."""
    for blocks in weights:
        check_args(x, blocks, block_type)
    if not available():
        return [gguf_matmul_reference(x, blocks, block_type) for blocks in weights]
    type_id = np.int32(BLOCK_TYPES[block_type][0])
    if x.shape[0] > KERNEL_MAX_ROWS:
        dequantized = (jax.ffi.ffi_call(DEQUANTIZE_TARGET, jax.ShapeDtypeStruct((b.shape[0], x.shape[1]), jnp.float32))(
            b, block_type=type_id) for b in weights)
        return [jax.lax.dot_general(x.astype(jnp.float32), w, (((1,), (1,)), ((), ()))) for w in dequantized]
    outs = [jax.ShapeDtypeStruct((x.shape[0], b.shape[0]), jnp.float32) for b in weights]
    return list(jax.ffi.ffi_call(TARGET, outs)(x.astype(jnp.float32), *weights, block_type=type_id))
