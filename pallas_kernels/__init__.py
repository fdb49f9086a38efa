"""Pallas kernels for NVIDIA GPUs (each with a pure-JAX reference beside it)."""
from pallas_kernels.ragged_paged_attention import Tuning, contiguous_ragged_attention, ragged_paged_attention
from pallas_kernels.ragged_paged_attention_reference import (contiguous_ragged_attention_reference,
                                                              ragged_paged_attention_reference)

__all__ = ["Tuning", "contiguous_ragged_attention", "contiguous_ragged_attention_reference", "ragged_paged_attention",
           "ragged_paged_attention_reference"]
