"""Accuracy of FP8 weights and an FP8 KV cache against the same model in bf16 (and f32), on the embedded SmolLM2
by default: perplexity of jaxserve/data/eval_prose.txt, the mean KL divergence of next-token distributions and
top-1 agreement against the reference (jaxserve.accuracy: the paged path as served), and how long greedy outputs of
held chat prompts stay token-identical to the reference's through the engine.

  python benchmarks/accuracy.py                      # CPU: ~10 min on two cores
  python benchmarks/accuracy.py --max-tokens 512     # a quick look
Rows: bench "accuracy", impl the configuration, params {model, reference, tokens}; results
benchmarks/results/accuracy_<backend>.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import write_rows  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.accuracy import compare, eval_ids, paged_log_probs, perplexity  # noqa: E402
from jaxserve.models.loader import load_model  # noqa: E402

# (name, weights dtype, quantization, kv_cache_dtype); the first is the reference. "float": the model in that dtype,
# as a GPU serves it (on a CPU a GGUF file's blocks would otherwise stay blocks: another model than "bf16")
CONFIGS = (("bf16", "bf16", "float", "auto"), ("f32", "f32", "float", "auto"),
           ("fp8-weights", "bf16", "fp8", "auto"), ("fp8-kv", "bf16", "float", "fp8"),
           ("fp8-weights+kv", "bf16", "fp8", "fp8"))
HELD_PROMPTS = (
    "Summarise the plot of Romeo and Juliet in two sentences.", "What is the boiling point of water at sea level?",
    "Write a Python function that reverses a string.", "List three uses of copper.",
    "Explain what a prime number is to a child.", "Translate 'good morning' into French and Spanish.",
    "What causes the seasons on Earth?", "Give me a haiku about autumn leaves.",
    "How do I make a cup of tea?", "What is the difference between weather and climate?",
    "Name the planets of the solar system in order.", "Why is the sky blue?",
    "Write a short thank-you note to a teacher.", "What is photosynthesis?",
    "Suggest a name for a pet turtle.", "How many minutes are in a day? Show the arithmetic.",
)


def matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_outputs(loaded, kv_dtype: str, max_tokens: int) -> list[list[int]]:
    llm = LLM(loaded, kv_cache_dtype=kv_dtype, precompile=False)
    convs = [[{"role": "user", "content": p}] for p in HELD_PROMPTS]
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--max-tokens", type=int, default=None, help="of the eval text (default: all of it)")
    ap.add_argument("--greedy-tokens", type=int, default=48, help="tokens generated per held prompt")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    command = "python benchmarks/accuracy.py " + " ".join(argv if argv is not None else sys.argv[1:])
    runs = {}
    for name, dtype, quantization, kv in CONFIGS:
        start = time.perf_counter()
        loaded = load_model(args.model, dtype, quantization=quantization)
        ids = eval_ids(loaded.tokenizer, args.max_tokens)
        runs[name] = (paged_log_probs(loaded, ids, kv), greedy_outputs(loaded, kv, args.greedy_tokens))
        print(f"{name}: perplexity {perplexity(runs[name][0], ids):.4f} ({time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
    reference, (ref_lp, ref_greedy) = CONFIGS[0][0], runs[CONFIGS[0][0]]
    rows = []
    for name, (lp, greedy) in runs.items():
        agreement = compare(ref_lp, lp, ids)
        prefixes = [matching_prefix(a, b) for a, b in zip(ref_greedy, greedy)]
        rows.append({"bench": "accuracy", "impl": name,
                     "params": {"model": args.model or "smollm2-135m-instruct", "reference": reference,
                                "tokens": len(ids), "greedy_tokens": args.greedy_tokens},
                     **asdict(agreement), "perplexity_ratio": agreement.perplexity / perplexity(ref_lp, ids),
                     "greedy_identical": float(np.mean([p == args.greedy_tokens for p in prefixes])),
                     "greedy_matching_prefix_mean": float(np.mean(prefixes))})
        r = rows[-1]
        print(f"{name:16s} ppl {r['perplexity']:.4f} ({r['perplexity_ratio']:.4f}x), KL {r['mean_kl']:.5f}, "
              f"top-1 {r['top1_agreement']:.4f}, greedy identical {r['greedy_identical']:.2f} "
              f"(mean matching prefix {r['greedy_matching_prefix_mean']:.1f}/{args.greedy_tokens})", flush=True)
    write_rows(args.out or f"benchmarks/results/accuracy_{jax.default_backend()}.json", rows, command)


if __name__ == "__main__":
    main()
