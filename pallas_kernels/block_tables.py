"""Block ids of contiguous (vAttention) cache rows, as the kernels, their references and the engine address them:
block j of row s is s * blocks_per_row + j; in a cross-layer cache viewed as [num_blocks * num_layers, ...], layer
l of it is (s * blocks_per_row + j) * num_layers + l."""
import jax.numpy as jnp


def strided_block_tables(first, blocks_per_row: int, stride: int = 1):
    """[max_seqs, blocks_per_row] int32: row i lists first[i], first[i] + stride, ... (a contiguous row's blocks)."""
    return first[:, None] + jnp.arange(blocks_per_row, dtype=jnp.int32) * stride


def row_starts(kv_rows, blocks_per_row: int, num_layers: int = 1, layer=0):
    """Each row's first block at `layer`, in the cache viewed as [num_blocks * num_layers, block_size, ...]."""
    if num_layers == 1:
        return kv_rows * blocks_per_row
    return kv_rows * (blocks_per_row * num_layers) + jnp.asarray(layer, jnp.int32)


def identity_block_tables(kv_rows, blocks_per_row: int, num_layers: int = 1, layer=0):
    """[max_seqs, blocks_per_row] int32: table row i lists cache row kv_rows[i]'s blocks, kv_rows[i] * blocks_per_row
    + j, at `layer` of a cross-layer cache of num_layers (see the module)."""
    return strided_block_tables(row_starts(kv_rows, blocks_per_row, num_layers, layer), blocks_per_row, num_layers)
