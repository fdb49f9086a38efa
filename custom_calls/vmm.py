"""ctypes binding of csrc/vmm_manager.cu, vAttention's per-device VMM manager.

The manager is mechanism only (reserve, page pool, map / unmap with fences, the look-ahead mapper thread,
DLPack export); jaxserve/cache/vattention.py decides what to map. The library is libjaxserve_cuda.so, built by
custom_calls/build.py like the FFI handlers; it loads without a GPU, and `dry_run=True` managers (no driver)
let CPU tests drive the C++ bookkeeping.
"""
from __future__ import annotations

import ctypes
import functools
import weakref

import jax
import jax.numpy as jnp

from custom_calls import build

FENCE_TARGET, FENCE_SYMBOL = "jaxserve_vmm_fence", "JaxserveVmmFence"
KDL_CUDA = 2
DLPACK_DTYPES = {jnp.dtype(jnp.float32): (2, 32), jnp.dtype(jnp.float16): (2, 16),
                 jnp.dtype(jnp.bfloat16): (4, 16),
                 jnp.dtype(jnp.float8_e4m3fn): (10, 8)}   # DLPack (type code, bits); 10 is kDLFloat8_e4m3fn
_DLTENSOR_NAME = b"dltensor"   # the capsule keeps this pointer: it must outlive every capsule

_I64, _VP = ctypes.c_int64, ctypes.c_void_p
SIGNATURES = {   # name -> (restype, argtypes)
    "vmm_last_error": (ctypes.c_char_p, []),
    "vmm_granularity": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(_I64)]),
    "vmm_create": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, _I64, _I64, _I64, ctypes.c_int,
                                  ctypes.POINTER(_VP)]),
    "vmm_destroy": (ctypes.c_int, [_VP]),
    "vmm_page_size": (_I64, [_VP]),
    "vmm_base": (ctypes.c_uint64, [_VP, ctypes.c_int]),
    "vmm_map": (ctypes.c_int, [_VP, ctypes.c_int, _I64]),
    "vmm_map_async": (ctypes.c_int, [_VP, ctypes.c_int, _I64]),
    "vmm_sync": (ctypes.c_int, [_VP]),
    "vmm_trim": (ctypes.c_int, [_VP, ctypes.c_int, _I64]),
    "vmm_record_fence": (ctypes.c_int, [_VP, _VP]),
    "vmm_poll": (ctypes.c_int, [_VP]),
    "vmm_num_mapped": (_I64, [_VP, ctypes.c_int]),
    "vmm_num_free_pages": (_I64, [_VP]),
    "vmm_num_deferred": (_I64, [_VP]),
    "vmm_dry_complete_fences": (_I64, [_VP, ctypes.c_uint64]),
    "vmm_export_dlpack": (ctypes.c_int, [_VP, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_I64), ctypes.c_uint8,
                                         ctypes.c_uint8, ctypes.POINTER(_VP)]),
}


class VmmError(RuntimeError):
    """The VMM manager (or the driver under it) refused; the message says why."""


@functools.cache
def load(path: str | None = None) -> ctypes.CDLL:
    """The library at `path` (default: libjaxserve_cuda.so, built on first use) with its C ABI declared."""
    try:
        library = ctypes.CDLL(str(path or build.build_library()))
    except (build.BuildError, OSError) as err:
        raise VmmError(f"vAttention: cannot load the CUDA library: {err}") from err
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(library, name)
        fn.restype, fn.argtypes = restype, argtypes
    return library


@functools.cache   # once per process: every engine (data-parallel replicas too) calls it
def register_fence(path: str | None = None) -> None:
    """Registers the FFI fence handler for platform CUDA (as custom_calls.register does for the others)."""
    jax.ffi.register_ffi_target(FENCE_TARGET, jax.ffi.pycapsule(getattr(load(path), FENCE_SYMBOL)), platform="CUDA")


def fence(x: jax.Array) -> jax.Array:
    """Inside the jitted step: x unchanged, after which the device's manager records a fence on XLA's stream.
    Pass what the step computes after its last cache read (e.g. the logits). Not declared side-effecting: its
    output is used, so XLA keeps it after every read, and an effect would take the step off JAX's C++ dispatch
    path (an unordered effect does: a Python dispatch of every weight and cache array, every step)."""
    return jax.ffi.ffi_call(FENCE_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), input_output_aliases={0: 0})(x)


def granularity(device: int = 0, path: str | None = None) -> int:
    """The driver's recommended VMM page size on `device` (2 MiB with the stock driver)."""
    library, out = load(path), _I64()
    _check(library, library.vmm_granularity(device, ctypes.byref(out)), "granularity")
    return out.value


def _check(library: ctypes.CDLL, rc: int, what: str) -> int:
    if rc < 0:
        raise VmmError(f"vmm {what}: {library.vmm_last_error().decode()}")
    return rc


class _DLPackRange:
    """What jax.dlpack.from_dlpack consumes: a legacy "dltensor" capsule whose deleter is C++."""

    def __init__(self, managed: int, device: int):
        self.managed, self.device = managed, device

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [_VP, ctypes.c_char_p, _VP]
        return new(self.managed, _DLTENSOR_NAME, None)

    def __dlpack_device__(self):
        return KDL_CUDA, self.device


class VmmManager:
    """One device's ranges and page pool: see csrc/vmm_manager.cu. A row is a sequence's span of every range."""

    def __init__(self, *, device: int, num_rows: int, num_tensors: int, row_bytes: int, num_pages: int,
                 page_size: int, dry_run: bool = False, path: str | None = None):
        self.lib, self.device, handle = load(path), device, _VP()
        rc = self.lib.vmm_create(device, num_rows, num_tensors, row_bytes, num_pages, page_size, int(dry_run),
                                 ctypes.byref(handle))
        if rc < 0:
            error = self.lib.vmm_last_error().decode()
            if "out of memory" in error:
                raise VmmError(f"vAttention's page pool ({num_pages} pages of {page_size >> 20} MiB in each of "
                               f"{num_tensors} ranges, {num_pages * num_tensors * page_size / 2**30:.1f} GiB) does "
                               f"not fit device {device}'s free memory: lower memory_fraction or num_blocks ({error})")
            raise VmmError(f"vAttention needs an NVIDIA GPU with a CUDA driver (device {device}): {error}")
        self.handle = handle
        # a manager dropped without close() (an engine let go) must still give its page pool back
        self._destroy = weakref.finalize(self, self.lib.vmm_destroy, handle)

    def _live(self) -> ctypes.c_void_p:
        if self.handle is None:
            raise VmmError("vmm manager is closed")
        return self.handle

    def _call(self, name: str, *args) -> int:
        return _check(self.lib, getattr(self.lib, name)(self._live(), *args), name.removeprefix("vmm_"))

    def map(self, row: int, num_pages: int) -> None:
        self._call("vmm_map", row, num_pages)

    def map_async(self, row: int, num_pages: int) -> None:
        self._call("vmm_map_async", row, num_pages)

    def sync(self) -> None:
        self._call("vmm_sync")

    def trim(self, row: int, keep_pages: int) -> None:
        self._call("vmm_trim", row, keep_pages)

    def record_fence(self, stream: int = 0) -> None:
        self._call("vmm_record_fence", stream)

    def poll(self) -> None:
        self._call("vmm_poll")

    def num_mapped(self, row: int) -> int:
        return self._call("vmm_num_mapped", row)

    @property
    def num_free_pages(self) -> int:
        return self._call("vmm_num_free_pages")

    @property
    def num_deferred(self) -> int:
        """Virtual pages trimmed whose unmap still waits on a fence."""
        return self._call("vmm_num_deferred")

    def complete_fences(self, upto: int) -> int:
        """Dry run only: fences 1..upto have completed; returns how many page addresses are mapped."""
        return self._call("vmm_dry_complete_fences", upto)

    def base(self, tensor: int) -> int:
        return self.lib.vmm_base(self._live(), tensor)

    def export(self, tensor: int, shape: tuple[int, ...], dtype) -> jax.Array:
        """Range `tensor` as a zero-copy jax.Array (most of it unmapped: never let XLA read it whole)."""
        code, bits = DLPACK_DTYPES[jnp.dtype(dtype)]
        dims, managed = (_I64 * len(shape))(*shape), _VP()
        self._call("vmm_export_dlpack", tensor, len(shape), dims, code, bits, ctypes.byref(managed))
        return jax.dlpack.from_dlpack(_DLPackRange(managed.value, self.device), copy=False)

    def close(self) -> None:
        """Drops this handle; the memory goes once every exported array is gone too."""
        self._destroy()
        self.handle = None
