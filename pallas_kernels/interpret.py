"""The one place that knows how Pallas spells "interpret this kernel on the CPU" for our backend.

Our kernels use the Triton lowering, whose `pallas_call(interpret=...)` takes a bool. (A Mosaic GPU kernel
would take `jax.experimental.pallas.mosaic_gpu.InterpretGPUParams()` here instead.) If jax renames it,
this function is the only line to change.
"""


def interpret_params(interpret: bool) -> bool:
    """Value for `pallas_call(interpret=...)`: run on the CPU through the HLO interpreter when asked."""
    return bool(interpret)
