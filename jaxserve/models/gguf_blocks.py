"""Linear layers and embeddings that keep a GGUF file's quantized blocks (Q4_1, Q8_0) as their weights, multiplied
through custom_calls.gguf_matmul: on the CPU a decode step reads the file's 5-8.5 bits a weight, not f32's 32, and
computes in f32 what the dequantized model computes."""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from flax import nnx

from custom_calls.gguf_matmul import dequantize, gguf_matmul, gguf_matmuls, row_bytes


@dataclass(frozen=True, slots=True)
class GgufBlocks:
    """The block types a model keeps: its decoder's linear layers', and its embedding's and LM head's (None: in
    the model dtype)."""
    linear: str
    embedding: str | None = None
    lm_head: str | None = None


class GgufLinear(nnx.Module):
    """y = x W^T + b, W kept as blocks [out, in / 32 * bytes] in the file's row order."""

    def __init__(self, in_features: int, out_features: int, block_type: str, *, use_bias: bool, dtype):
        self.weight = nnx.Param(jnp.zeros((out_features, row_bytes(block_type, in_features)), jnp.uint8))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None
        self.block_type, self.dtype = block_type, dtype

    def __call__(self, x, live=None):
        """live: the step's real rows, which the GGUF kernels do not use (they run every row)."""
        return self.output(gguf_matmul(x.reshape(-1, x.shape[-1]), self.weight[...], self.block_type), x)

    def output(self, y, x):
        """The product y [N, out] (f32) of x [..., in] as the layer's output: its dtype, x's leading dims, the bias."""
        y = y.astype(self.dtype).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias[...]


def gguf_linears(layers: list[GgufLinear], x) -> list:
    """[layer(x) for layer in layers] for layers of one block type that read the same x, in one kernel call."""
    ys = gguf_matmuls(x.reshape(-1, x.shape[-1]), [layer.weight[...] for layer in layers], layers[0].block_type)
    return [layer.output(y, x) for layer, y in zip(layers, ys)]


class GgufEmbed(nnx.Module):
    """A token embedding kept as blocks [vocab, hidden / 32 * bytes]: a lookup dequantizes the rows it takes; as a
    tied LM head it multiplies in blocks."""

    def __init__(self, num_embeddings: int, features: int, block_type: str, dtype):
        self.embedding = nnx.Param(jnp.zeros((num_embeddings, row_bytes(block_type, features)), jnp.uint8))
        self.block_type, self.dtype = block_type, dtype

    def __call__(self, token_ids):
        return dequantize(self.embedding[...][token_ids], self.block_type).astype(self.dtype)

    def dequantized(self):
        """The whole table [vocab, hidden] in the model dtype."""
        return dequantize(self.embedding[...], self.block_type).astype(self.dtype)

    def attend(self, hidden):
        """hidden [N, H] -> f32 logits [N, vocab]."""
        return gguf_matmul(hidden, self.embedding[...], self.block_type)
