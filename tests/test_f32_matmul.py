"""custom_calls.f32_matmuls: the CPU kernel for a decode step's f32 linears against a float64 product, and the
model's Linear layers taking it."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from custom_calls import cpu as cpu_calls, f32_matmul as fm
from jaxserve.models.fp8 import Fp8Linear, NormedRows
from jaxserve.models.llama import Linear, f32_kernel_takes, linears

# (rows of x, input features, output features of each weight): every row count the kernel takes, contractions
# shorter than a slice and not a multiple of its streams, outputs not a multiple of a vector (the scalar tail)
SHAPES = [(1, 576, (576, 192, 192)), (2, 1536, (576,)), (3, 100, (7, 1536)), (4, 35, (64, 9)), (1, 3, (16,))]


def kernel_required():
    if not cpu_calls.available():
        pytest.skip(f"the CPU kernel does not run here: {cpu_calls.unavailable_reason()}")


@pytest.mark.parametrize("m, k, ns", SHAPES)
def test_kernel_and_reference_match_f64(m, k, ns):
    kernel_required()
    rng = np.random.default_rng([m, k, *ns])
    x = rng.standard_normal((m, k)).astype(np.float32)
    ws = [(rng.standard_normal((k, n)) * 0.05).astype(np.float32) for n in ns]
    kernel = jax.jit(fm.f32_matmuls)(x, ws)
    for got, w in zip(kernel, ws):
        want = x.astype(np.float64) @ w.astype(np.float64)
        # f32 sums of k products in different orders: within k * 2^-24 of the sum of |x w| (4x for the slices' adds)
        atol = 4 * k * 2.0 ** -24 * float((np.abs(x) @ np.abs(w)).max())
        for out in (np.asarray(got), np.asarray(fm.f32_matmul_reference(x, w))):
            assert out.shape == (m, w.shape[1]) and np.isfinite(out).all()
            np.testing.assert_allclose(out, want, rtol=0, atol=atol)


def test_one_call_for_weights_of_one_input_and_its_threads_agree_with_one():
    """f32_matmuls over q, k and v is one custom call; each output has the bits its weight alone gives (each slice
    adds the same rows in the same order), run after run (the slices' sums are added in slice order, whichever
    thread ran them)."""
    kernel_required()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 576)).astype(np.float32)
    ws = [rng.standard_normal((576, n)).astype(np.float32) for n in (576, 192, 192)]
    fn = jax.jit(fm.f32_matmuls)
    assert fn.lower(x, ws).as_text().count(f"@{fm.TARGET}(") == 1
    first = [np.asarray(y) for y in fn(x, ws)]
    for _ in range(5):
        for y, want in zip(fn(x, ws), first):
            np.testing.assert_array_equal(np.asarray(y), want)
    for w, want in zip(ws, first):
        np.testing.assert_array_equal(np.asarray(jax.jit(fm.f32_matmuls)(x, [w])[0]), want)


@pytest.mark.parametrize("x, w, message", [
    (np.zeros((fm.MAX_ROWS + 1, 8), np.float32), np.zeros((8, 8), np.float32), "x must be float32 [1 to 4, in]"),
    (np.zeros((1, 8), jnp.bfloat16), np.zeros((8, 8), np.float32), "x must be float32"),
    (np.zeros((1, 8), np.float32), np.zeros((9, 8), np.float32), "each kernel must be float32 [8, out]"),
])
def test_bad_arguments_name_what_is_wrong(x, w, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fm.f32_matmuls(jnp.asarray(x), [jnp.asarray(w)])


def test_decode_rows_of_the_f32_model_take_the_kernel_and_prefill_rows_xla():
    """A lone CPU's f32 Linear layers run their few decode rows through the kernel (q, k and v in one call), more
    rows through XLA's dot; both give the layers' f32 products."""
    kernel_required()
    rngs = nnx.Rngs(0)
    layers = [Linear(64, n, use_bias=n == 32, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
              for n in (64, 32, 32)]
    for rows, calls in ((fm.MAX_ROWS, 1), (fm.MAX_ROWS + 1, 0)):
        x = jax.random.normal(jax.random.key(rows), (rows, 64), jnp.float32)
        assert f32_kernel_takes(layers, x) == bool(calls)
        fn = nnx.jit(linears)
        assert fn.lower(layers, x).as_text().count(f"@{fm.TARGET}(") == calls
        ys = fn(layers, x)
        assert nnx.jit(lambda layer, x: layer(x)).lower(layers[1], x).as_text().count(f"@{fm.TARGET}(") == calls
        ys[1] = nnx.jit(lambda layer, x: layer(x))(layers[1], x)   # one layer alone, its bias added
        for y, layer in zip(ys, layers):
            want = np.asarray(x, np.float64) @ np.asarray(layer.kernel[...], np.float64)
            want = want + (0 if layer.bias is None else np.asarray(layer.bias[...], np.float64))
            # f32 sums of 64 products of order 1 round within ~1e-5; a wrong or missing product is off by ~0.1
            np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=1e-4)
    assert not f32_kernel_takes(layers, jnp.zeros((1, 64), jnp.bfloat16))


def test_fp8_layers_and_their_normed_rows_keep_their_path():
    """FP8 layers (whose W8A8 input may be NormedRows, no array) never reach the f32 kernel's checks of x."""
    layers = [Fp8Linear(64, n, use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)) for n in (64, 32)]
    x = jnp.ones((2, 64), jnp.bfloat16)
    assert not f32_kernel_takes(layers, NormedRows(x, jnp.ones(64, jnp.bfloat16), 1e-5))
    assert not f32_kernel_takes(layers, x.astype(jnp.float32))
