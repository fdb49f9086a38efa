"""The CPU custom calls: libjaxserve_cpu.so (`csrc/*.cc`, x86-64 with AVX2, FMA and F16C) through the XLA FFI,
built with the C++ compiler on first use (`build.build_cpu_library`). Its handlers: the GGUF block matmul and
dequantization (`gguf_matmul`), the f32 linears of decode steps (`f32_matmul`), ragged paged attention
(`paged_attention_cpu`) and the in-place cache write and block copy (`custom_calls.reshape_and_cache`,
`copy_blocks`). Each module runs its pure-JAX reference where the library does not (`available()`), after one
logged notice naming why."""
import ctypes
import functools
import logging

import jax

from custom_calls import build

log = logging.getLogger(__name__)

# FFI target name -> symbol exported by libjaxserve_cpu.so
TARGETS = {
    "jaxserve_gguf_matmul": "JaxserveGgufMatmul",
    "jaxserve_gguf_dequantize": "JaxserveGgufDequantize",
    "jaxserve_f32_matmul": "JaxserveF32Matmul",
    "jaxserve_ragged_paged_attention_cpu": "JaxserveRaggedPagedAttentionCpu",
    # the CUDA library's cache ops under the same names (custom_calls.reshape_and_cache, copy_blocks)
    "jaxserve_reshape_and_cache": "JaxserveReshapeAndCacheCpu",
    "jaxserve_copy_blocks": "JaxserveCopyBlocksCpu",
}


def cpu_supports_library() -> bool:
    """The library's instructions (AVX2, FMA, F16C) on this CPU (Linux's /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return {"avx2", "fma", "f16c"} <= set(flags)


@functools.cache
def unavailable_reason() -> str | None:
    """Why the CPU kernels are off (None when on): the default backend is not the CPU, the CPU lacks AVX2/FMA/F16C,
    or the library could not be built."""
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not the CPU"
    if not cpu_supports_library():
        return "this CPU lacks AVX2, FMA or F16C"
    try:
        library = ctypes.cdll.LoadLibrary(str(build.build_cpu_library()))
    except (build.BuildError, OSError) as e:
        return f"the CPU custom calls did not build or load: {e}"
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return None


def available() -> bool:
    reason = unavailable_reason()
    if reason is not None:
        _log_once(reason)
    return reason is None


@functools.cache
def _log_once(reason: str) -> None:
    log.info("the CPU custom calls are off, their pure-JAX references run instead: %s", reason)
