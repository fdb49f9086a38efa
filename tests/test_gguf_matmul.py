"""custom_calls.gguf_matmul: the CPU kernel and its pure-JAX reference against a float64 product of the weights
llama.cpp's own dequantization (the gguf package's) gives, on blocks gguf.quants encodes from fresh random floats."""
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from custom_calls import build, cpu as cpu_calls, gguf_matmul as gm

# (rows of x, output features, input features): one and several rows (the kernel's 4-row tiles and each
# remainder), outputs fewer than a thread's chunk and not a multiple of it, one block and many
SHAPES = [(1, 576, 576), (2, 192, 576), (3, 100, 64), (4, 1, 32), (5, 1536, 576), (9, 576, 1536), (17, 33, 96)]


def random_blocks(rng, out_features, in_features, block_type):
    w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05
    blocks = gguf_quantize(w, GGMLQuantizationType[block_type])
    return blocks, gguf_dequantize(blocks, GGMLQuantizationType[block_type]).astype(np.float64)


def kernel_required():
    if not cpu_calls.available():
        pytest.skip(f"the CPU kernel does not run here: {cpu_calls.unavailable_reason()}")


@pytest.mark.parametrize("block_type", list(gm.BLOCK_TYPES))
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_kernel_and_reference_match_llama_cpps_dequantization(m, n, k, block_type):
    kernel_required()
    rng = np.random.default_rng([m, n, k, len(block_type)])
    blocks, w = random_blocks(rng, n, k, block_type)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x.astype(np.float64) @ w.T
    kernel = np.asarray(jax.jit(gm.gguf_matmul, static_argnums=2)(x, blocks, block_type))
    reference = np.asarray(jax.jit(gm.gguf_matmul_reference, static_argnums=2)(x, blocks, block_type))
    # f32 sums of k products of |x w| <= ~0.2 each, in different orders: k * 2^-24 relative to the sum of |x w|
    atol = 4 * k * 2.0 ** -24 * float(np.abs(x).max() * np.abs(w).max()) + 1e-6
    for got in (kernel, reference):
        assert got.shape == (m, n) and np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("block_type", list(gm.BLOCK_TYPES))
def test_dequantization_is_llama_cpps_and_feeds_the_gemm_of_many_rows(block_type):
    """The reference's dequantization and the library's (which XLA's GEMM takes past KERNEL_MAX_ROWS rows) give
    exactly the gguf package's weights."""
    rng = np.random.default_rng(7)
    blocks, w = random_blocks(rng, 136, 96, block_type)
    np.testing.assert_array_equal(np.asarray(gm.dequantize(jnp.asarray(blocks), block_type)), w.astype(np.float32))
    kernel_required()
    x = rng.standard_normal((gm.KERNEL_MAX_ROWS + 7, 96)).astype(np.float32)
    fn = jax.jit(gm.gguf_matmul, static_argnums=2)
    assert gm.DEQUANTIZE_TARGET in fn.lower(x, blocks, block_type).as_text()
    got = np.asarray(fn(x, blocks, block_type))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
    identity = np.eye(96, dtype=np.float32)[:gm.KERNEL_MAX_ROWS + 1]   # rows of x picking single weights: exact
    np.testing.assert_array_equal(np.asarray(fn(identity, blocks, block_type)),
                                  w.astype(np.float32)[:, :gm.KERNEL_MAX_ROWS + 1].T)


def test_the_kernel_is_the_custom_call_and_its_threads_agree_with_one():
    """The public op lowers to the FFI call on the CPU up to KERNEL_MAX_ROWS rows, to the dequantizing call and XLA's
    dot past them; a run is repeatable (the threads' row chunks never race)."""
    kernel_required()
    rng = np.random.default_rng(3)
    blocks, _ = random_blocks(rng, 1536, 576, "Q4_1")
    x = rng.standard_normal((1, 576)).astype(np.float32)
    fn = jax.jit(gm.gguf_matmul, static_argnums=2)
    assert gm.TARGET in fn.lower(x, blocks, "Q4_1").as_text()
    many_rows = fn.lower(np.zeros((gm.KERNEL_MAX_ROWS + 1, 576), np.float32), blocks, "Q4_1").as_text()
    assert gm.TARGET not in many_rows and gm.DEQUANTIZE_TARGET in many_rows
    first = np.asarray(fn(x, blocks, "Q4_1"))
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(fn(x, blocks, "Q4_1")), first)


@pytest.mark.parametrize("x_shape, blocks_shape, block_type, message", [
    ((1, 48), (4, 30), "Q4_1", "multiple of 32"),
    ((1, 64), (4, 41), "Q4_1", "do not cover"),
    ((1, 64), (4, 68), "Q5_0", "is not one of"),
    ((64,), (4, 40), "Q4_1", "need x [M, in]"),
])
def test_bad_arguments_name_what_is_wrong(x_shape, blocks_shape, block_type, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        gm.gguf_matmul(jnp.zeros(x_shape), jnp.zeros(blocks_shape, jnp.uint8), block_type)


def test_the_cpu_library_is_built_once_and_exports_its_handler(tmp_path, monkeypatch):
    try:
        build.find_cxx()
    except build.BuildError as err:
        pytest.skip(f"no C++ compiler on this machine: {err}")
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    library = build.build_cpu_library()
    exported = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                              check=True).stdout
    assert " T JaxserveGgufMatmul\n" in exported and " T JaxserveGgufDequantize\n" in exported
    built_at = library.stat().st_mtime_ns
    assert build.build_cpu_library() == library and library.stat().st_mtime_ns == built_at   # same key: cached


@pytest.mark.parametrize("m", [1, 5])
def test_weights_of_one_input_in_one_call_give_what_each_gives(m):
    """gguf_matmuls (q, k, v; gate, up) is one custom call over all its weights' rows, split over the threads as one
    range (here a chunk spans two matrices); each output has the bits its weight alone gives (the same products in
    the same order)."""
    kernel_required()
    rng = np.random.default_rng(11)
    weights = [random_blocks(rng, n, 576, "Q4_1")[0] for n in (576, 192, 192)]
    x = rng.standard_normal((m, 576)).astype(np.float32)
    fn = jax.jit(gm.gguf_matmuls, static_argnums=2)
    assert fn.lower(x, weights, "Q4_1").as_text().count(f"@{gm.TARGET}(") == 1
    alone = jax.jit(gm.gguf_matmul, static_argnums=2)
    for together, w in zip(fn(x, weights, "Q4_1"), weights):
        assert together.shape == (m, w.shape[0]) and np.isfinite(np.asarray(together)).all()
        np.testing.assert_array_equal(np.asarray(together), np.asarray(alone(x, w, "Q4_1")))
