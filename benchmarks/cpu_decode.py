"""CPU batch-1 decode of the embedded model against its peers and the memory roofline, in one run.

Measured interleaved, `--repeats` rounds (a shared machine's noise hits every impl alike):
- jaxserve: one greedy stream (temperature 0 set explicitly, EOS ignored) of `--output-len` tokens after a warm-up
  generation: TPOT (median ms between tokens after the first) and tok/s; with the default config (the GGUF's Q4_1 /
  Q8_0 blocks kept, custom_calls.gguf_matmul), with `quantization="float"` (the blocks dequantized to f32 at
  load: transformers' weights) and (`--fp8-kv`) the default over an FP8 KV cache;
- transformers: HF `LlamaForCausalLM`, eager PyTorch, on the same GGUF dequantized to f32 (the tests' oracle),
  greedy `generate` in a process of its own (its threads never meet JAX's), torch threads = the cores JAX uses;
  `match`: its first tokens equal to jaxserve's;
- llama.cpp: `llama-bench` (its own Q4_1 kernels, same GGUF, same threads) when `--llama-bench` or PATH has it;
- the memory ceilings on the cores XLA uses, best of the run over a 1 GiB f32 array: copy (an in-place scale, bytes
  read + written as STREAM counts them) and read (a sum). The weight-read roofline is a bandwidth over the bytes a
  decode step reads (every layer's weights and the LM head, once, as the impl stores them: GGUF blocks for jaxserve's
  default and llama.cpp, f32 for the others); decode reads only, so the read one is the bound;
- batched: `--batch-prompts` random prompts x `--batch-input-len` tokens, `--batch-output-len` out, greedy
  (offline.py's CPU row), so batched throughput is seen beside batch 1;
- a first `jaxserve generate` in a fresh process on this warm machine (executables and the prepared model on disk),
  twice.

  .venv/bin/python benchmarks/cpu_decode.py        # rows in benchmarks/results/cpu_decode.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import Bytes, write_rows  # noqa: E402
from benchmarks.first_generate import ROOT, generate_s  # noqa: E402
from benchmarks.offline import weight_read_bytes  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.models.loader import DEFAULT_MODEL, embedded_model_path  # noqa: E402

GiB = 1 << 30
F32 = "jaxserve (f32 weights)"   # quantization="float": the GGUF's blocks dequantized at load
FP8_KV = "jaxserve (fp8 KV cache)"   # --fp8-kv: the default engine over an FP8 KV cache
Stream = tuple[list[int] | None, float]   # a run's tokens (None: not reported) and TPOT in ms


def cores() -> int:
    return len(os.sched_getaffinity(0))


def ceilings_gbps(nbytes: int = GiB, repeats: int = 5) -> tuple[float, float]:
    """(copy, read) GB/s, best of `repeats`: an in-place negation of a donated array (read + written) and its sum."""
    negate, total = jax.jit(jnp.negative, donate_argnums=0), jax.jit(jnp.sum)
    x = jax.block_until_ready(negate(jnp.ones(nbytes // 4, jnp.float32)))
    copy = read = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x = jax.block_until_ready(negate(x))
        copy = min(copy, time.perf_counter() - start)
        start = time.perf_counter()
        jax.block_until_ready(total(x))
        read = min(read, time.perf_counter() - start)
    return 2 * nbytes / copy / 1e9, nbytes / read / 1e9


def tpot_ms(stamps: list[float]) -> float:
    """Median ms between tokens after the first (the decode phase)."""
    return float(np.median(np.diff(stamps[1:])) * 1e3)


def jaxserve_stream(engine, prompt_ids: list[int], output_len: int) -> Stream:
    """One greedy request through the engine's step loop, each token timed as it reaches the host."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rid, stamps, tokens = engine.add_request(prompt_ids, params), [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            new = out.outputs[0].token_ids[len(tokens):] if out.request_id == rid else []
            stamps += [time.perf_counter()] * len(new)
            tokens += new
    return tokens, tpot_ms(stamps)


def jaxserve_batch(engine, prompts: list[list[int]], output_len: int) -> float:
    """Seconds to generate output_len greedy tokens for every prompt at once."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def hf_stream(model, prompt_ids: list[int], output_len: int) -> Stream:
    """Greedy `generate` (eager PyTorch), each new token timed by its streamer."""
    import torch
    stamps = []

    class Stamps:
        def put(self, value):
            stamps.append(time.perf_counter())

        def end(self):
            pass
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0,
                             streamer=Stamps())
    return out[0, len(prompt_ids):].tolist(), tpot_ms(stamps[1:])   # the first put is the prompt


def serve_transformers() -> None:
    """The HF peer's process: load the model, then one stream per stdin line `[prompt ids, output len]`, answered
    as one stdout line `[tokens, TPOT ms]`."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(cores())
    path = embedded_model_path(DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for line in sys.stdin:
        print(json.dumps(hf_stream(model, *json.loads(line))), flush=True)


class TransformersPeer:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve-transformers"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def stream(self, prompt_ids: list[int], output_len: int) -> Stream:
        self.proc.stdin.write(json.dumps([prompt_ids, output_len]) + "\n")
        self.proc.stdin.flush()
        tokens, ms = json.loads(self.proc.stdout.readline())
        return tokens, ms

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


class LlamaBench:
    """llama.cpp's own decode benchmark (`llama-bench -p 0 -n N`: N tokens from an empty context)."""

    def __init__(self, path: str):
        self.path = path

    def stream(self, prompt_ids: list[int], output_len: int) -> Stream:
        out = subprocess.run([self.path, "-m", str(embedded_model_path(DEFAULT_MODEL)), "-p", "0", "-n",
                              str(output_len), "-t", str(cores()), "-r", "1", "-o", "json"],
                             check=True, capture_output=True, text=True)
        return None, 1e3 / json.loads(out.stdout)[0]["avg_ts"]

    def close(self) -> None:
        pass


def matching_prefix(a: list[int] | None, b: list[int]) -> int | None:
    if a is None:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def stream_row(impl: str, params: dict, runs: list[Stream], reference: list[int], roofline: dict) -> dict:
    """An impl's row: median TPOT over the runs (ms, tok_s), its best, tokens equal to jaxserve's, roofline shares."""
    tpots = [ms for _, ms in runs]
    ms = float(np.median(tpots))
    return {"bench": "cpu_decode", "impl": impl, "params": params, "ms": ms, "tok_s": 1e3 / ms, "tpot_runs_ms": tpots,
            "tpot_best_ms": min(tpots), "match": matching_prefix(runs[0][0], reference),
            **{f"{name}_roofline_frac": 1e3 / ms / tok_s for name, tok_s in roofline.items()}}


def make_peers(args) -> dict:
    peers = {} if args.no_peers else {"transformers": TransformersPeer()}
    llama_bench = args.llama_bench or shutil.which("llama-bench")
    if llama_bench and not args.no_peers:
        peers["llama.cpp"] = LlamaBench(llama_bench)
    elif not args.no_peers:
        print("llama.cpp: skipped (no llama-bench: build llama.cpp and pass --llama-bench PATH)", flush=True)
    return peers


def measure(args, engines: dict, prompt_ids: list[int], batch: list[list[int]]) -> tuple[dict, list[float], dict]:
    """Interleaved rounds: ceilings, each impl's stream, the default engine's batched run. (runs by impl, batched
    seconds, ceilings)"""
    peers, engine = make_peers(args), engines["jaxserve"]
    for peer in peers.values():
        peer.stream(prompt_ids, 8)   # warm-up
    runs, batch_s, best = {name: [] for name in (*engines, *peers)}, [], (0.0, 0.0)
    for r in range(args.repeats):
        copy, read = ceilings_gbps()
        best = max(best[0], copy), max(best[1], read)
        for name, e in engines.items():
            runs[name].append(jaxserve_stream(e, prompt_ids, args.output_len))
        for name, peer in peers.items():
            runs[name].append(peer.stream(prompt_ids, args.output_len))
        batch_s.append(jaxserve_batch(engine, batch, args.batch_output_len))
        print(f"round {r}: copy {copy:.1f} GB/s, read {read:.1f} GB/s, "
              + ", ".join(f"{name} TPOT {rs[-1][1]:.1f} ms" for name, rs in runs.items())
              + f", batched {batch_s[-1]:.2f} s", flush=True)
    for peer in peers.values():
        peer.close()
    return runs, batch_s, {"copy_gbps": best[0], "read_gbps": best[1]}


def decode_rows(args, engines: dict, prompt_ids: list[int], runs: dict, batch_s: list[float], ceilings: dict):
    """The rows of the streams (each with the ceilings and the rooflines of the bytes its weights take) and of the
    batched runs."""
    def roofline(engine) -> dict:
        weight_bytes = weight_read_bytes(engine.loaded.config, Bytes.of(engine.loaded, engine.cfg))
        return {"weight_bytes": weight_bytes, "weights": engine.loaded.quantization or str(engine.loaded.dtype),
                "copy_roofline_tok_s": ceilings["copy_gbps"] * 1e9 / weight_bytes,
                "read_roofline_tok_s": ceilings["read_gbps"] * 1e9 / weight_bytes}
    loaded = engines["jaxserve"].loaded
    rooflines = {name: roofline(e) for name, e in engines.items()}
    # llama.cpp reads the GGUF's blocks, as the default jaxserve does; transformers f32 weights
    rooflines |= {"llama.cpp": rooflines["jaxserve"], "transformers": rooflines[F32]}
    params = {"prompt_tokens": len(prompt_ids), "output_len": args.output_len, "threads": cores(),
              "dtype": str(loaded.dtype), "model": DEFAULT_MODEL, "repeats": args.repeats}
    rows = [stream_row(name, params, rs, runs["jaxserve"][0][0], {kind: rooflines[name][f"{kind}_roofline_tok_s"]
                                                                   for kind in ("copy", "read")})
            | ceilings | rooflines[name] for name, rs in runs.items()]
    wall = float(np.median(batch_s))
    return rows + [{"bench": "cpu_decode_batched", "impl": "jaxserve", "ms": wall * 1e3,
                    "params": {"num_prompts": args.batch_prompts, "input_len": args.batch_input_len,
                               "output_len": args.batch_output_len, "threads": cores(), "model": DEFAULT_MODEL},
                    "tok_s": args.batch_prompts * args.batch_output_len / wall, "wall_runs_s": batch_s}]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-prompts", type=int, default=16)
    ap.add_argument("--batch-input-len", type=int, default=64)
    ap.add_argument("--batch-output-len", type=int, default=16)
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (default: on PATH)")
    ap.add_argument("--no-peers", action="store_true", help="jaxserve and the ceilings only")
    ap.add_argument("--no-first-generate", action="store_true")
    ap.add_argument("--fp8-kv", action="store_true", help="also the default engine over an FP8 KV cache")
    ap.add_argument("--out", default="benchmarks/results/cpu_decode.json")
    ap.add_argument("--serve-transformers", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.serve_transformers:
        return serve_transformers()
    command = "python benchmarks/cpu_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
    llms = {"jaxserve": LLM(), F32: LLM(quantization="float"), **({FP8_KV: LLM(kv_cache_dtype="fp8")} if args.fp8_kv
                                                                 else {})}
    engines = {name: llm.engine for name, llm in llms.items()}
    prompt_ids = engines["jaxserve"].tokenize(args.prompt)
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, engines["jaxserve"].loaded.config.vocab_size, args.batch_input_len).tolist()
             for _ in range(args.batch_prompts)]
    for engine in engines.values():   # warm-up: first transfers, allocator, each graph's first run
        jaxserve_stream(engine, prompt_ids, 8)
    jaxserve_batch(engines["jaxserve"], batch, args.batch_output_len)
    rows = decode_rows(args, engines, prompt_ids, *measure(args, engines, prompt_ids, batch))
    if not args.no_first_generate:
        del llms, engines, engine   # the fresh processes get this one's memory
        starts = [generate_s(ROOT, args.prompt, 16) for _ in range(2)]
        rows.append({"bench": "cpu_first_generate", "impl": "jaxserve", "params": {"max_tokens": 16},
                     "ms": starts[-1] * 1e3, "first_s": starts[0], "warm_s": starts[-1]})
    report(rows)
    write_rows(args.out, rows, command)


def report(rows: list[dict]) -> None:
    js = rows[0]
    print(f"ceilings: copy {js['copy_gbps']:.1f} GB/s, read {js['read_gbps']:.1f} GB/s")
    for r in rows:
        if r["bench"] == "cpu_decode":
            print(f"{r['impl']:>22}: TPOT {r['ms']:.1f} ms ({r['tok_s']:.1f} tok/s; best {r['tpot_best_ms']:.1f} ms); "
                  f"{r['weight_bytes'] / 1e6:.0f} MB of weights ({r['weights']}) a token: "
                  f"{r['copy_roofline_frac']:.0%} of that copy roofline, "
                  f"{r['read_roofline_frac']:.0%} of the read one; "
                  f"jaxserve is {js['tok_s'] / r['tok_s']:.2f}x; tokens equal to jaxserve's: {r['match']}")
        elif r["bench"] == "cpu_decode_batched":
            print(f"batched {r['params']['num_prompts']} x {r['params']['input_len']}/{r['params']['output_len']}: "
                  f"{r['ms'] / 1e3:.2f} s, {r['tok_s']:.1f} tok/s")
        else:
            print(f"`jaxserve generate`: {r['first_s']:.1f} s, again: {r['warm_s']:.1f} s")


if __name__ == "__main__":
    main()
