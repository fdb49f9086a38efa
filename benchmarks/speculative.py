"""Speculative decoding, measured with speculation on and off in the same run.

grounded: the embedded SmolLM2 at batch 1 (each prompt alone) over benchmarks/data/grounded_prompts.jsonl
  (summarise / rewrite / extract from a given text, edit given code), greedy: output tok/s, mean acceptance length,
  and whether every answer is the one decoding without speculation gives; n-gram drafts (--num-speculative-tokens)
  and draft models (--draft-layers N: the model's first N layers with its embeddings, final norm and LM head, the
  only smaller model with its tokenizer at hand; N = all its layers: the model as its own draft, every draft
  accepted, the bound of what a draft can give at the cost of the model itself).
verify-cost: an 8B-shaped model (random weights): the model + sampler graphs of a step whose B rows each compute
  k + 1 tokens (their last token and k drafts) against a plain decode step of B rows, at a context of --context
  tokens; with a Llama-3.2-1B-shaped draft model and with an EAGLE-3 head of the published Llama-3.1-8B head's
  shapes (--drafters), the same verify step (which writes the draft's KV too) and the drafting graph (k greedy
  draft steps in one launch). From these, the projected batch-1 speedup at a mean acceptance length (marked as a
  projection): n-gram L x T_decode / T_verify(k + 1), a draft model or head
  L x T_decode / (T_verify+draft(k + 1) + T_drafting(k)).
random-draft PATH: writes the random 1B-shaped draft (for benchmarks/offline.py --set speculative_config=...);
random-eagle3 PATH: a random EAGLE-3 head for the 8B shape, in the published layout.
The batch-256 check is benchmarks/offline.py with --set speculative_config={...} beside a run without it.

  python benchmarks/speculative.py grounded --num-speculative-tokens 2 4 6 --draft-layers 8 30   # GPU (CPU: slow)
  python benchmarks/speculative.py verify-cost --config configs/llama3-8b-random.yaml
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import write_rows  # noqa: E402
from benchmarks.grounded_prompts import load as load_prompts  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.config import EngineConfig, SpeculativeConfig, load_run_config, model_config_from_hf  # noqa: E402
from jaxserve.engine.drafter import draft_inputs  # noqa: E402
from jaxserve.models.eagle3 import save_random_eagle3  # noqa: E402
from jaxserve.models.loader import (DEFAULT_MODEL, LoadedModel, load_model, load_run, parse_dtype,  # noqa: E402
                                    random_model, save_converted)

OUT = "benchmarks/results/speculative.json"
LLAMA_32_1B = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                   num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                   max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True)


# ---- grounded prompts, embedded model, batch 1 ------------------------------------------------------------------
def decode_each(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Each prompt alone (batch 1), one after another: wall seconds and the answers' tokens."""
    start, answers = time.perf_counter(), []
    for prompt in prompts:
        answers.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    return time.perf_counter() - start, answers


def first_layers(loaded: LoadedModel, num_layers: int, path: str) -> str:
    """The model cut to its first num_layers decoder layers (embeddings, final norm, LM head kept), saved at path."""
    cfg = dataclasses.replace(loaded.config, num_layers=num_layers)
    model = nnx.merge(*nnx.split(loaded.model))   # a new module tree over the same weights
    model.layers, model.cfg = nnx.List([model.layers[i] for i in range(num_layers)]), cfg
    return str(save_converted(dataclasses.replace(loaded, config=cfg, model=model), path))


def grounded(args, command: str) -> None:
    """Every engine is built first (a fixed cache each, so they fit together); the prompt set then runs on each in
    turn, --rounds times: each one's wall time is its median round, so drift on the machine falls on all alike."""
    loaded = load_model(args.model, dtype=args.dtype)
    tokenizer = loaded.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                             add_generation_prompt=True) for r in load_prompts()][:args.num_prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    base = EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024, min_prefill_chunk=64, max_model_len=2048,
                        num_blocks=4096)
    methods = {"off": None, **{f"ngram-k{k}": SpeculativeConfig(num_speculative_tokens=k)
                               for k in args.num_speculative_tokens}}
    for n in args.draft_layers:
        model = first_layers(loaded, n, os.path.join(args.draft_dir, f"first-{n}-layers"))
        methods[f"draft-{n}of{loaded.config.num_layers}-layers-k{args.draft_k}"] = SpeculativeConfig(
            method="draft", model=model, num_speculative_tokens=args.draft_k)
    engines = {name: LLM(loaded, config=dataclasses.replace(base, speculative_config=spec))
               for name, spec in methods.items()}
    walls, answers = {name: [] for name in engines}, {}
    for llm in engines.values():
        decode_each(llm, prompts[:2], params)   # warm-up
    for _ in range(args.rounds):
        for name, llm in engines.items():
            wall, answers[name] = decode_each(llm, prompts, params)
            walls[name].append(wall)
    rows = []
    for name, llm in engines.items():
        wall, ntok, stats = float(np.median(walls[name])), sum(map(len, answers[name])), llm.engine.stats()
        same = sum(a == b for a, b in zip(answers[name], answers["off"])) / len(prompts)
        gaps = divergence_gaps(engines["off"], prompts, answers["off"], answers[name])
        spec = methods[name]
        row = {"bench": "speculative_grounded", "impl": name,
               "params": {"model": "smollm2-135m-instruct", "dtype": str(loaded.dtype), "num_prompts": len(prompts),
                          "max_tokens": args.max_tokens, "method": spec and spec.method,
                          "num_speculative_tokens": spec.num_speculative_tokens if spec else 0, "batch": 1,
                          "rounds": args.rounds},
               "ms": wall * 1e3, "tok_s": ntok / wall, "output_tokens": ntok, "round_walls_s": walls[name],
               "mean_acceptance_length": stats["spec_mean_acceptance_length"],
               "draft_tokens": stats["spec_num_draft_tokens"], "accepted_tokens": stats["spec_num_accepted_tokens"],
               "compiles_after_start": stats["compiles_after_start"], "same_answers_as_off": same,
               "divergence_top2_gaps": gaps}
        row["speedup_vs_off"] = row["tok_s"] / (rows[0]["tok_s"] if rows else row["tok_s"])
        rows.append(row)
        print(f"{row['impl']}: {row['tok_s']:.1f} tok/s ({row['speedup_vs_off']:.2f}x off) over {len(prompts)} prompts "
              f"({ntok} tokens; rounds {', '.join(f'{w:.1f}' for w in walls[name])} s), mean acceptance length "
              f"{row['mean_acceptance_length']:.2f}, answers as off: {same:.0%} (where not, off's top-2 logprob gap at "
              f"the first different token: median {np.median(gaps) if gaps else 0:.3f}, max {max(gaps, default=0):.3f})"
              f", compiles after start {row['compiles_after_start']}", flush=True)
    write_rows(args.out, rows, command)


def divergence_gaps(off: LLM, prompts: list[str], expected: list[list[int]], got: list[list[int]]) -> list[float]:
    """Where an answer differs from off's: off's logprob gap between its top two tokens at the first token that
    differs. Near zero: a near-tie that rounding in a step of another shape flips (bf16), not a wrong verification."""
    gaps, engine = [], off.engine
    for prompt, a, b in zip(prompts, expected, got):
        if a == b:
            continue
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        ids = engine.tokenize(prompt) + a[:first]
        top = off.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, logprobs=2),
                           use_tqdm=False)[0].outputs[0].logprobs[0]
        best = sorted(top.values(), reverse=True)
        gaps.append(float(best[0] - best[1]))
    return sorted(gaps)


# ---- the cost side on an 8B shape ----------------------------------------------------------------------------------
def median_ms(run, repeats: int, warmup: int = 3) -> float:
    """Median ms of run() to its outputs' readiness, after warm-up calls."""
    times = []
    for i in range(warmup + repeats):
        t = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t)
    return float(np.median(times[warmup:]) * 1e3)


def block_tables(llm: LLM, batch: int, num_tokens: int) -> np.ndarray:
    """Block tables of `batch` rows of num_tokens tokens each, distinct blocks per row."""
    graphs = llm.engine.graphs
    blocks = -(-num_tokens // llm.engine.cfg.block_size)
    tables = np.zeros((batch, graphs.max_blocks_per_seq), np.int32)
    tables[:, :blocks] = 1 + np.arange(batch * blocks).reshape(batch, blocks)
    if tables.max() >= graphs.num_blocks:
        raise SystemExit(f"batch {batch} of {num_tokens} tokens needs {tables.max() + 1} blocks; the cache has "
                         f"{graphs.num_blocks}")
    return tables


def step_ms(llm: LLM, batch: int, width: int, context: int, repeats: int) -> float:
    """Median ms of the model and sampler graphs of one step of `batch` rows at `context`, each computing `width`
    tokens (width - 1 drafts; 1: a plain decode step), inputs from the host as the engine sends them."""
    engine, rng = llm.engine, np.random.default_rng(0)
    graphs, runner = engine.graphs, engine.runner
    tables = block_tables(llm, batch, context + width)
    decode_only = width == 1
    tokens, seqs, decode_only, *_ = graphs.model_key(batch * width, batch, decode_only, width).dims
    vocab = graphs.model_config.vocab_size
    inputs = graphs.step_inputs(
        num_tokens=tokens, num_seqs=seqs, decode_only=decode_only, block_tables=tables, starts=[context] * batch,
        counts=[width] * batch, token_ids=rng.integers(0, vocab, batch * width), slots=np.arange(batch),
        sample_mask=[True] * batch, params=[SamplingParams(temperature=0.0)] * batch, seeds=[0] * batch,
        num_generated=[0] * batch, sampler_mode="greedy",
        draft_ids=rng.integers(0, vocab, (batch, width - 1)).tolist() if width > 1 else None, spec_width=width)
    return median_ms(lambda: runner.run(inputs), repeats)


def drafting_ms(llm: LLM, batch: int, context: int, repeats: int) -> float:
    """Median ms of the drafting graph (k greedy draft steps in one launch) over `batch` rows at `context`."""
    engine = llm.engine
    runner = engine.runner
    key = engine.graphs.drafts_key(batch)
    k = engine.cfg.speculative_config.num_speculative_tokens
    inp = draft_inputs(np.ones(batch), np.full(batch, context), block_tables(llm, batch, context + k),
                       np.full(batch, k), key.dims[0])
    return median_ms(lambda: runner.run_drafts(inp), repeats)


def random_draft(path: str, dtype) -> str:
    """The random Llama-3.2-1B-shaped draft model, saved at path (a draft model is loaded by name or path)."""
    return str(save_converted(random_model(model_config_from_hf(LLAMA_32_1B), parse_dtype(dtype)), path))


def random_eagle3(path: str, config: str) -> str:
    """A random EAGLE-3 head of the published Llama-3.1-8B head's shapes (the target's widths, a draft vocabulary of
    32,000) for the random model of `config`, saved at path."""
    target = model_config_from_hf(load_run_config(config).random_model)
    return str(save_random_eagle3(path, target, draft_vocab_size=min(32000, target.vocab_size)))


DRAFTERS = {"draft": ("verify+draft-kv", "drafting"), "eagle3": ("verify+eagle3-kv", "eagle3-drafting")}


def verify_cost(args, command: str) -> None:
    loaded, cfg = load_run(None, args.config)
    cfg = dataclasses.replace(cfg, precompile=False, max_num_seqs=max(args.batch),
                              seq_buckets=tuple(sorted({*cfg.seq_buckets, *args.batch})) if cfg.seq_buckets else None)
    llm = LLM(loaded, config=cfg)
    rows, plain = [], {}
    for batch in args.batch:
        for width in [1, *args.width]:
            ms = step_ms(llm, batch, width, args.context, args.repeats)
            plain.setdefault(batch, ms)
            rows.append(cost_row("verify" if width > 1 else "decode", batch, width, args.context, ms, plain[batch]))
    del llm
    for method in args.drafters:
        draft = (random_draft(os.path.join(args.draft_dir, "llama3.2-1b-random"), loaded.dtype) if method == "draft"
                 else random_eagle3(os.path.join(args.draft_dir, "eagle3-llama3-8b-random"), args.config))
        for width in args.width:
            spec = SpeculativeConfig(method=method, model=draft, num_speculative_tokens=width - 1,
                                     max_num_seqs=max(args.draft_batch))
            llm = LLM(loaded, config=dataclasses.replace(cfg, num_blocks=2048, speculative_config=spec))
            verify, drafting = DRAFTERS[method]
            for batch in args.draft_batch:
                ms = step_ms(llm, batch, width, args.context, args.repeats)
                rows.append(cost_row(verify, batch, width, args.context, ms, plain[batch]))
                ms = drafting_ms(llm, batch, args.context, args.repeats)
                rows.append(cost_row(drafting, batch, width, args.context, ms, plain[batch]))
            del llm
    rows += projection_rows(rows, args.acceptance_length)
    write_rows(args.out, rows, command)


def cost_row(impl: str, batch: int, width: int, context: int, ms: float, decode_ms: float) -> dict:
    """verify: the target's step of k + 1 tokens a row; verify+draft-kv: that step writing the 1B draft's KV too;
    drafting: the 1B draft's k greedy steps in one launch; the same two for an EAGLE-3 head (eagle3)."""
    print(f"{impl}, batch {batch}, {width} token(s) a row: {ms:.2f} ms ({ms / decode_ms:.2f}x decode)", flush=True)
    draft_model = "eagle3-llama3-8b-random" if "eagle3" in impl else "llama3.2-1b-random" if "draft" in impl else None
    return {"bench": "speculative_verify_cost", "impl": impl,
            "params": {"model": "llama3-8b-random", "draft_model": draft_model,
                       "batch": batch, "width": width, "context": context},
            "ms": ms, "tok_s": batch / ms * 1e3, "cost_vs_decode": ms / decode_ms}


def projection_rows(rows: list[dict], acceptance_length: float) -> list[dict]:
    """Projected batch-1 speedups from measured step costs: a step of k drafts emits at most k + 1 tokens, so the
    mean acceptance length is capped there. n-gram: the verify step; a draft model: the verify step writing the
    draft's KV, plus the drafting graph."""
    ms = {(r["impl"], r["params"]["width"]): r["ms"] for r in rows
          if r["bench"] == "speculative_verify_cost" and r["params"]["batch"] == 1}
    out = []
    for width in sorted(w for impl, w in ms if impl == "verify"):
        k, length = width - 1, min(acceptance_length, width)
        costs = {"ngram": ms[("verify", width)]}
        for method, (verify, drafting) in DRAFTERS.items():
            if (drafting, width) in ms:
                costs[method] = ms[(verify, width)] + ms[(drafting, width)]
        for method, cost in costs.items():
            speedup = length * ms[("decode", 1)] / cost
            out.append({"bench": "speculative_projection", "impl": method,
                        "params": {"model": "llama3-8b-random", "batch": 1, "num_speculative_tokens": k,
                                   "mean_acceptance_length": length}, "ms": cost, "tok_s": length / cost * 1e3,
                        "projected_speedup": speedup})
            print(f"projection ({method}, k={k}, L={length}): {speedup:.2f}x batch-1 decode", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="case", required=True)
    g = sub.add_parser("grounded")
    g.add_argument("--num-speculative-tokens", type=int, nargs="*", default=[4], help="n-gram engines' k")
    g.add_argument("--draft-layers", type=int, nargs="*", default=[], help="draft models: the model's first N layers")
    g.add_argument("--draft-k", type=int, default=4, help="the draft-model engines' num_speculative_tokens")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--num-prompts", type=int, default=None, help="the first N prompts (None: all)")
    g.add_argument("--rounds", type=int, default=3)
    g.add_argument("--model", default=DEFAULT_MODEL, help="the embedded model's name, or its GGUF file")
    g.add_argument("--dtype", default=None, help="None: f32 on CPU, bf16 on GPU")
    v = sub.add_parser("verify-cost")
    v.add_argument("--config", default="configs/llama3-8b-random.yaml")
    v.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 256])
    v.add_argument("--draft-batch", type=int, nargs="+", default=[1, 8], help="batches of the draft-model rows")
    v.add_argument("--width", type=int, nargs="+", default=[2, 4, 6, 8], help="tokens a verifying row computes (k+1)")
    v.add_argument("--context", type=int, default=512)
    v.add_argument("--repeats", type=int, default=20)
    v.add_argument("--acceptance-length", type=float, default=3.0)
    v.add_argument("--drafters", nargs="*", default=list(DRAFTERS), choices=list(DRAFTERS),
                   help="draft: a Llama-3.2-1B-shaped model; eagle3: an EAGLE-3 head")
    for p in (g, v):
        p.add_argument("--out", default=OUT)
        p.add_argument("--draft-dir", default="/tmp/jaxserve-drafts", help="where draft models are written")
    r = sub.add_parser("random-draft")
    r.add_argument("path")
    r.add_argument("--dtype", default="bfloat16")
    e = sub.add_parser("random-eagle3")
    e.add_argument("path")
    e.add_argument("--config", default="configs/llama3-8b-random.yaml")
    args = ap.parse_args(argv)
    if args.case == "random-draft":
        print(random_draft(args.path, args.dtype))
        return
    if args.case == "random-eagle3":
        print(random_eagle3(args.path, args.config))
        return
    command = "python benchmarks/speculative.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (grounded if args.case == "grounded" else verify_cost)(args, command)


if __name__ == "__main__":
    main()
