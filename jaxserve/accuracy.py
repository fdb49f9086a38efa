"""What a serving configuration (FP8 weights, an FP8 KV cache) costs in accuracy against another on the same
weights: perplexity of a shipped text, the mean KL divergence of next-token distributions and how often the
top token agrees. Logits come from the paged path as served: the text is one prefill step whose K/V are written
to a cache of the configuration's dtype and read back by the engine's attention kernels, so every layer after
the first attends over what the cache holds."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.cache.kv_cache import allocate_kv_cache, is_quantized_kv, kv_cache_dtype
from jaxserve.models.attention import AttentionBatch, PagedAttention, resolve_attention_kernels
from jaxserve.models.kv_calibration import calibrate_kv_scales, calibration_ids

EVAL_TEXT = Path(__file__).parent / "data" / "eval_prose.txt"   # public-domain prose, ~2,900 SmolLM2 tokens
BLOCK_SIZE = 16
LOGIT_ROWS = 512   # logits computed this many positions at a time: [T, vocab] f32 whole would be large


def eval_ids(tokenizer, max_tokens: int | None = None) -> np.ndarray:
    ids = tokenizer.encode(EVAL_TEXT.read_text(), add_special_tokens=False)
    return np.asarray(ids[:max_tokens], np.int32)


def paged_log_probs(loaded, ids: np.ndarray, kv_dtype: str = "auto") -> np.ndarray:
    """[T, vocab] f32 log-probabilities after each token of one sequence, run as one prefill step through a
    paged cache of kv_dtype (an FP8 cache's scales calibrated first unless the checkpoint brought them)."""
    cfg, num_tokens = loaded.config, len(ids)
    dtype = kv_cache_dtype(kv_dtype, loaded.dtype, jax.devices()[0].platform)
    if is_quantized_kv(dtype) and not loaded.kv_scales_loaded:
        calibrate_kv_scales(loaded.model, calibration_ids(loaded.tokenizer, cfg.vocab_size))
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    cache = allocate_kv_cache(cfg.num_layers, num_blocks + 1, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype)
    batch = AttentionBatch(slot_mapping=jnp.arange(num_tokens, dtype=jnp.int32) + BLOCK_SIZE,   # blocks 1, 2, ...
                           cu_q_lens=jnp.array([0, num_tokens], jnp.int32),
                           kv_lens=jnp.array([num_tokens], jnp.int32),
                           block_tables=jnp.arange(1, num_blocks + 1, dtype=jnp.int32)[None],
                           num_seqs=jnp.array([1], jnp.int32))
    kernels = resolve_attention_kernels("auto", "triton", cfg.head_dim, cache_dtype=dtype)
    hidden, _ = loaded.model(jnp.asarray(ids), jnp.arange(num_tokens, dtype=jnp.int32), cache,
                             PagedAttention(batch, kernels, loaded.mesh))
    log_probs = nnx.jit(lambda model, h: jax.nn.log_softmax(model.logits(h), axis=-1))
    return np.concatenate([np.asarray(log_probs(loaded.model, hidden[i:i + LOGIT_ROWS]))
                           for i in range(0, num_tokens, LOGIT_ROWS)])


@dataclass(frozen=True, slots=True)
class Agreement:
    perplexity: float        # of the text under the configuration
    mean_kl: float           # KL(reference || configuration) per position, nats
    top1_agreement: float    # positions whose most likely next token is the reference's


def perplexity(log_probs: np.ndarray, ids: np.ndarray) -> float:
    return float(np.exp(-np.mean(log_probs[np.arange(len(ids) - 1), ids[1:]])))


def compare(reference: np.ndarray, other: np.ndarray, ids: np.ndarray) -> Agreement:
    """reference, other: paged_log_probs of the same ids."""
    kl = np.sum(np.exp(reference) * (reference - other), axis=-1)
    return Agreement(perplexity(other, ids), float(kl.mean()),
                     float(np.mean(reference.argmax(-1) == other.argmax(-1))))
