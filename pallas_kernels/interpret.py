"""The one place that knows how Pallas spells "interpret this kernel on the CPU", per backend.

The Triton-lowered kernels take a bool in `pallas_call(interpret=...)`; the Mosaic GPU kernel takes
`InterpretGPUParams()` in `plgpu.kernel(interpret=...)`. If jax renames either, only this file changes.
"""
from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_params(interpret: bool) -> bool:
    """Triton backend: run on the CPU through the HLO interpreter when asked."""
    return bool(interpret)


def mosaic_interpret_params(interpret: bool):
    """Mosaic GPU backend: its warpgroup-level interpreter when asked, else None (compile for the GPU)."""
    return plgpu.InterpretGPUParams() if interpret else None
