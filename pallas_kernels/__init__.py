"""Pallas kernels for NVIDIA GPUs (each with a pure-JAX reference beside it)."""
from pallas_kernels.ragged_paged_attention import Tuning, ragged_paged_attention
from pallas_kernels.ragged_paged_attention_reference import ragged_paged_attention_reference

__all__ = ["Tuning", "ragged_paged_attention", "ragged_paged_attention_reference"]
