"""Does a finer FP8 scale granularity buy accuracy? The embedded SmolLM2 in bf16 with its linear layers' weights and
inputs rounded through e4m3 (fake quantization: rounded, then computed in bf16), one scale per output channel / per
token against one per `--group`-wide slice of K, the way block-scaled FP8 GEMMs take them. Perplexity, mean KL and
top-1 agreement against the bf16 model on the shipped text (jaxserve.accuracy, the paged path as served).

  python benchmarks/fp8_scales.py --max-tokens 1024     # CPU: ~2 min
Rows: bench "fp8_scales", impl the configuration, params {weights, activations, group, tokens}; results
benchmarks/results/fp8_scales_<backend>.json.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import write_rows  # noqa: E402

from custom_calls import FP8_MAX  # noqa: E402
from jaxserve.accuracy import compare, eval_ids, paged_log_probs, perplexity  # noqa: E402
from jaxserve.models import llama  # noqa: E402
from jaxserve.models.loader import load_model  # noqa: E402

# (weights' scales, activations' scales): None keeps bf16, "row" one scale per output channel / token, "group" one
# per --group elements of K
CONFIGS = ((None, None), ("row", None), ("group", None), ("row", "row"), ("group", "group"), ("row", "group"))


def through_e4m3(x, group: int | None):
    """x [..., K] rounded through e4m3, each run of `group` elements along K (None: all of K) scaled so its amax
    maps to FP8_MAX."""
    xf = x.astype(jnp.float32)
    runs = xf.reshape(*xf.shape[:-1], -1, group or xf.shape[-1])
    scale = jnp.maximum(jnp.max(jnp.abs(runs), axis=-1, keepdims=True) / FP8_MAX, jnp.finfo(jnp.float32).tiny)
    q = jnp.clip(runs / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
    return q.reshape(xf.shape).astype(x.dtype)


def run(weights, activations, group: int, ids):
    """The model's log-probs of ids with its Linear layers' weights and inputs rounded as asked."""
    loaded = load_model(None, "bf16", quantization="float")
    for _, layer in nnx.iter_graph(loaded.model):
        if weights and isinstance(layer, llama.Linear):   # kernel [in, out]: K runs along axis 0
            layer.kernel[...] = through_e4m3(layer.kernel[...].T, group if weights == "group" else None).T
    linear_call = llama.Linear.__call__

    def rounded_inputs(layer, x, live=None):
        return linear_call(layer, through_e4m3(x, group if activations == "group" else None), live)
    jax.clear_caches()   # the traced model holds the inputs' rounding: no graph of another configuration reused
    if activations:
        llama.Linear.__call__ = rounded_inputs
    try:
        return paged_log_probs(loaded, ids)
    finally:
        llama.Linear.__call__ = linear_call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=1024, help="of the eval text")
    ap.add_argument("--group", type=int, default=64, help="K elements a scale covers (SmolLM2's 576 = 9 x 64)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    command = "python benchmarks/fp8_scales.py " + " ".join(argv if argv is not None else sys.argv[1:])
    ids = eval_ids(load_model(None, "bf16", quantization="float").tokenizer, args.max_tokens)
    reference, rows = None, []
    for weights, activations in CONFIGS:
        log_probs = run(weights, activations, args.group, ids)
        reference = log_probs if reference is None else reference
        agreement = compare(reference, log_probs, ids)
        name = f"weights-{weights or 'bf16'}+activations-{activations or 'bf16'}"
        rows.append({"bench": "fp8_scales", "impl": name,
                     "params": {"weights": weights, "activations": activations, "group": args.group,
                                "tokens": len(ids), "model": "smollm2-135m-instruct"},
                     **asdict(agreement), "perplexity_ratio": agreement.perplexity / perplexity(reference, ids)})
        print(f"{name:36s} ppl {agreement.perplexity:.4f} ({rows[-1]['perplexity_ratio']:.4f}x), "
              f"KL {agreement.mean_kl:.5f}, top-1 {agreement.top1_agreement:.4f}", flush=True)
    write_rows(args.out or f"benchmarks/results/fp8_scales_{jax.default_backend()}.json", rows, command)


if __name__ == "__main__":
    main()
