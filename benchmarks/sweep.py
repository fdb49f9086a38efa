"""`jaxserve bench sweep`: compile and time the jitted step of every (num_tokens x num_seqs) bucket on synthetic
batches with real context, and weigh the token-bucket ladder against simulated traffic.

  jaxserve bench sweep --config configs/llama3-8b-random.yaml                        # one GPU: every bucket
  jaxserve bench sweep --config configs/smollm2-135m-instruct.yaml --token-buckets 16 32 64 128 256 \
      --seq-buckets 8 32 --contexts 128 512 --warmup 2 --repeats 5                   # CPU, a few minutes
  python benchmarks/sweep.py ...                                                     # the same, no console script

Per bucket and case (kind "decode": num_seqs sequences of 1 token at `context`, num_tokens = num_seqs as the engine
pads them; "mixed": decodes at `context` for up to half the tokens plus one prefill chunk filling the rest), rows
`bench: "sweep"`
hold compile_s (trace + lower + compile, once per bucket: the context only changes values), the median step ms,
tok_s (real tokens), the bytes and FLOPs the real work needs at least, and roofline_frac = max(bytes / copy
bandwidth, FLOPs / matmul rate) / ms, both ceilings measured in the same run. Rows `bench: "ladder"` replay the
engine's own scheduler on lognormal traffic and price each candidate ladder: padding waste, modelled step time,
compile seconds and code bytes. Results: benchmarks/results/sweep_<backend>.json and PNG heat maps beside it.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import pathlib
import shlex
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.common import (Bytes, kernel_profile, linear_path_params, matmul_tflops,  # noqa: E402
                               memory_bandwidth_gbps, time_ms, write_rows)
from jaxserve.cache.kv_cache import (kv_bytes_per_block, kv_cache_dtype, kv_dtype_name,  # noqa: E402
                                     num_blocks_for_memory)
from jaxserve.cache.kv_cache_manager import KVCacheManager  # noqa: E402
from jaxserve.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig, ModelConfig  # noqa: E402
from jaxserve.engine.llm_engine import fit_to_model, start_device, weight_dtype  # noqa: E402
from jaxserve.engine.runner import ModelRunner  # noqa: E402
from jaxserve.engine.step_graphs import bucket_ladders  # noqa: E402
from jaxserve.engine.sampling_params import SamplingParams  # noqa: E402
from jaxserve.engine.scheduler import Scheduler  # noqa: E402
from jaxserve.engine.sequence import Sequence  # noqa: E402
from jaxserve.engine.step_inputs import StepInputs  # noqa: E402
from jaxserve.models.loader import load_run  # noqa: E402

KINDS = ("decode", "mixed")
MIXED_DECODE_SHARE = 0.5             # a mixed case gives decodes at most this share of its tokens
SWEEP_SAMPLING = SamplingParams(temperature=0.0)   # greedy, as the engine benchmarks' requests
HEATMAP_METRICS = ("tok_s", "roofline_frac", "compile_s")


@dataclass(slots=True)
class SweepCase:
    num_tokens: int   # token bucket T
    num_seqs: int     # sequence bucket S
    context: int      # kv length of every decode (and at least of the prefill chunk)
    kind: str         # decode | mixed


@dataclass(slots=True)
class Traffic:
    """Simulated load for the ladder analysis: lognormal prompt and output lengths, Poisson arrivals."""
    prompt_median: int = 256
    prompt_sigma: float = 1.0
    output_median: int = 128
    output_sigma: float = 0.8
    load: float = 0.7          # target mean running sequences / max_num_seqs (Little's law on output lengths)
    num_steps: int = 2000
    warmup_steps: int = 300    # dropped: the batch is still filling up


# ---- synthetic step inputs -------------------------------------------------------------------------------
def case_layout(case: SweepCase, max_model_len: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(first position, token count) of each real row, decodes first; None where the bucket can't hold the kind."""
    t, s, c = case.num_tokens, case.num_seqs, case.context
    if case.kind == "decode":
        return (np.full(s, c - 1, np.int32), np.ones(s, np.int32)) if s <= t else None
    decodes = min(s - 1, int(t * MIXED_DECODE_SHARE))
    chunk = min(t - decodes, max_model_len)
    chunk_end = min(max(c, chunk), max_model_len)   # a later chunk of a long prompt, or a whole short one
    return (np.array([c - 1] * decodes + [chunk_end - chunk], np.int32),
            np.array([1] * decodes + [chunk], np.int32))


def ragged_positions(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, position) of every real token, rows in order."""
    cu = np.concatenate([[0], np.cumsum(counts)])
    return np.repeat(np.arange(len(counts)), counts), np.arange(cu[-1]) - np.repeat(cu[:-1] - starts, counts)


def assign_blocks(kv_lens: np.ndarray, block_size: int, max_blocks_per_seq: int, num_blocks: int,
                  rng: np.random.Generator) -> np.ndarray:
    """Block table rows of distinct random blocks (never the null block 0); when the pool is short every
    block is reused about equally often — the bytes read stay the same, only the addresses repeat."""
    per_seq, pool = -(-kv_lens // block_size), num_blocks - 1
    total = int(per_seq.sum())
    table = np.zeros((len(kv_lens), max_blocks_per_seq), np.int32)
    table[np.arange(max_blocks_per_seq) < per_seq[:, None]] = 1 + rng.permutation(max(total, pool))[:total] % pool
    return table


def synthetic_inputs(runner: ModelRunner, case: SweepCase, rng: np.random.Generator) -> StepInputs | None:
    """The StepInputs the engine would build for the case (host numpy arrays, through the runner's own builder,
    so a decode case runs the decode kernel the engine runs); None if the kind doesn't fit."""
    layout, graphs = case_layout(case, runner.cfg.max_model_len), runner.graphs
    if layout is None:
        return None
    starts, counts = layout
    n = len(counts)
    tables = assign_blocks(starts + counts, runner.cfg.block_size, graphs.max_blocks_per_seq, runner.num_blocks, rng)
    return graphs.step_inputs(
        num_tokens=case.num_tokens, num_seqs=case.num_seqs, block_tables=tables, starts=starts, counts=counts,
        token_ids=rng.integers(0, graphs.model_config.vocab_size, counts.sum()), slots=np.arange(n),
        sample_mask=np.ones(n, bool), params=[SWEEP_SAMPLING] * n, seeds=list(range(n)), num_generated=[0] * n,
        sampler_mode="greedy")


# ---- cost model and measurement ----------------------------------------------------------------------------
def step_cost(mc: ModelConfig, b: Bytes, starts: np.ndarray, counts: np.ndarray) -> tuple[int, int]:
    """(bytes, FLOPs) the real work of a step needs at least: every weight and every context key/value read
    once, new K/V written; matmuls for every token, the LM head for each row's last token, exact causal
    (windowed) attention. Padding is not useful work, so it lowers the roofline fraction."""
    head = mc.vocab_size * mc.hidden_size
    layer_params = mc.num_params - head * (1 if mc.tie_word_embeddings else 2)
    window = mc.sliding_window or mc.max_position_embeddings
    _, pos = ragged_positions(starts, counts)
    keys = int(np.minimum(pos + 1, window).sum())
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * b.kv
    kv_read = int(np.minimum(starts + counts, window).sum())
    nbytes = (layer_params * b.linear + (head + len(pos) * mc.hidden_size) * b.other
              + kv_per_token * (kv_read + len(pos)))
    flops = 2 * len(pos) * layer_params + 2 * len(counts) * head + 4 * mc.num_layers * mc.num_heads * mc.head_dim * keys
    return nbytes, flops


def blocks_needed(cases: list[SweepCase], block_size: int, max_model_len: int) -> int:
    layouts = [layout for case in cases if (layout := case_layout(case, max_model_len)) is not None]
    return max((int((-(-(starts + counts) // block_size)).sum()) for starts, counts in layouts), default=1)


def sweep_runner(loaded, cfg: EngineConfig, cases: list[SweepCase]) -> ModelRunner:
    """A runner whose cache holds every case's blocks (or what fits in memory), not the serving-sized pool."""
    mc = loaded.config
    per_block = kv_bytes_per_block(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim,
                                   kv_cache_dtype(cfg.kv_cache_dtype, loaded.dtype))
    fits = cfg.num_blocks or num_blocks_for_memory(per_block, fraction=cfg.memory_fraction)
    needed = blocks_needed(cases, cfg.block_size, cfg.max_model_len)
    if needed >= fits:
        print(f"sweep: the cache holds {fits - 1} of the {needed} blocks the largest case reads; blocks are reused",
              file=sys.stderr)
    num_blocks = min(fits, 1 + needed)
    return start_device(loaded, dataclasses.replace(cfg, num_blocks=max(num_blocks, 2), precompile=False))[1]


def compile_step(runner: ModelRunner, inp: StepInputs) -> tuple[float, int, int]:
    """AOT-compile the runner's graphs of inp's step (the model for its bucket, decode-only or not; the greedy
    sampler, as the sweep's requests): (seconds, temp bytes, code bytes)."""
    start = time.perf_counter()
    executables = [runner.graphs.get(key) for key in runner.graphs.keys_of(inp)[:2]]
    seconds = time.perf_counter() - start
    mems = [e.memory_analysis() for e in executables]
    return (seconds, sum(getattr(m, "temp_size_in_bytes", 0) for m in mems),
            sum(getattr(m, "generated_code_size_in_bytes", 0) for m in mems))


def time_step(runner: ModelRunner, inp: StepInputs, warmup: int, repeats: int) -> float:
    """Median ms of the step through the runner, the donated cache and penalty state threaded as the engine's."""
    return time_ms(runner.run, inp, warmup=warmup, repeats=repeats)


def check_sweep_args(cfg: EngineConfig, token_buckets, seq_buckets, contexts, kinds, repeats: int) -> None:
    for name, values, high in (("token_buckets", token_buckets, None), ("seq_buckets", seq_buckets, cfg.max_num_seqs),
                               ("contexts", contexts, cfg.max_model_len)):
        if not values or min(values) < 1 or (high is not None and max(values) > high):
            raise ValueError(f"{name} must be non-empty integers in [1, {high or 'inf'}], got {list(values)}")
    if not kinds or set(kinds) - set(KINDS):
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {list(kinds)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")


def run_sweep(loaded, cfg: EngineConfig, *, token_buckets=None, seq_buckets=None, contexts=None, kinds=KINDS,
              warmup: int = 3, repeats: int = 10, seed: int = 0, profile: int = 0) -> list[dict]:
    """Rows `bench: "sweep"`, one per (bucket, context, kind) that fits; one compile per bucket.
    Buckets default to the config's ladders, contexts to max_model_len / 8, / 2 and max_model_len. profile > 0
    prints each case's `profile` costliest GPU kernels."""
    token_ladder, seq_ladder = bucket_ladders(cfg)
    token_buckets, seq_buckets = tuple(token_buckets or token_ladder), tuple(seq_buckets or seq_ladder)
    contexts = tuple(contexts or sorted({max(1, cfg.max_model_len // 8), cfg.max_model_len // 2, cfg.max_model_len}))
    check_sweep_args(cfg, token_buckets, seq_buckets, contexts, kinds, repeats)
    rng = np.random.default_rng(seed)
    weights = jnp.float8_e4m3fn if loaded.quantization == "fp8" else jnp.bfloat16
    ceilings = memory_bandwidth_gbps(), matmul_tflops(weights)   # before the cache takes the free memory
    # a decode step pads its tokens only to its seq bucket (step_graphs.step_shape): the engine runs no other
    cases = [SweepCase(s if k == "decode" else t, s, c, k) for t in token_buckets for s in seq_buckets
             for c in contexts for k in kinds if k != "decode" or t == token_buckets[0]]
    runner = sweep_runner(loaded, cfg, cases)
    rows, compiled = [], {}   # model graph key -> compile stats: one compile per graph the engine runs
    for case in cases:
        if (inp := synthetic_inputs(runner, case, rng)) is None:
            continue
        if inp.model.key not in compiled:
            compiled[inp.model.key] = compile_step(runner, inp)
        inp.model, inp.sampler = jax.device_put((inp.model, inp.sampler))
        ms = time_step(runner, inp, warmup, repeats)
        rows.append(sweep_row(runner, case, ms, compiled[inp.model.key], ceilings, Bytes.of(loaded, cfg),
                              weight_dtype(loaded)))
        for name, kernel_ms, count in kernel_profile(runner.run, inp, top=profile) if profile else ():
            print(f"    {kernel_ms:8.3f} ms x{count:4d} {name[:100]}", file=sys.stderr, flush=True)
    return rows


def sweep_row(runner: ModelRunner, case: SweepCase, ms: float, compile_stats, ceilings, b: Bytes,
              weights: str) -> dict:
    """The case's row; its params name the weight and KV dtypes (one results file holds bf16 and FP8 rows)."""
    (compile_s, temp_bytes, code_bytes), (gbps, tflops) = compile_stats, ceilings
    starts, counts = case_layout(case, runner.cfg.max_model_len)
    nbytes, flops = step_cost(runner.graphs.model_config, b, starts, counts)
    roofline_ms = max(nbytes / gbps / 1e6, flops / tflops / 1e9)
    params = {**dataclasses.asdict(case), "weight_dtype": weights,
              "kv_cache_dtype": kv_dtype_name(runner.graphs.backend.dtype), **linear_path_params()}
    row = {"bench": "sweep", "impl": "jaxserve", "params": params, "compile_s": compile_s, "ms": ms,
           "tok_s": counts.sum() / ms * 1e3, "bytes": nbytes, "flops": flops, "roofline_ms": roofline_ms,
           "roofline_frac": roofline_ms / ms, "real_tokens": int(counts.sum()), "real_seqs": len(counts),
           "temp_bytes": temp_bytes, "code_bytes": code_bytes, "memory_gbps": gbps, "matmul_tflops": tflops}
    print(f"sweep {case.kind:6s} T={case.num_tokens:5d} S={case.num_seqs:4d} ctx={case.context:5d}: "
          f"compile {compile_s:6.1f} s, {ms:8.2f} ms, {row['tok_s']:9.0f} tok/s, roofline {row['roofline_frac']:.0%}",
          file=sys.stderr, flush=True)
    return row


# ---- bucket-ladder analysis -----------------------------------------------------------------------------------
def simulate_steps(cfg: EngineConfig, traffic: Traffic, rng: np.random.Generator) -> np.ndarray:
    """[steps, 2] (num_tokens, num_seqs) of the batches the engine's scheduler forms under `traffic` (host only:
    no prefix hits, a pool big enough that nothing is preempted)."""
    kv = KVCacheManager(cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size) + 1, cfg.block_size,
                        enable_prefix_caching=False)
    scheduler, total = Scheduler(cfg, kv), traffic.warmup_steps + traffic.num_steps
    prompts, outputs = traffic_lengths(traffic, cfg.max_model_len, rng, n=total * cfg.max_num_seqs)
    arrivals = rng.poisson(traffic.load * cfg.max_num_seqs / (outputs.mean() + 1), total)
    requests, steps = zip(itertools.count(), prompts.tolist(), outputs.tolist()), []
    for step, num_new in enumerate(arrivals):
        for seq_id, prompt_len, max_tokens in itertools.islice(requests, num_new):
            scheduler.add(Sequence(seq_id, str(seq_id), 0, [0] * prompt_len, prompt_len,
                                   SamplingParams(max_tokens=int(max_tokens), ignore_eos=True), seed=0))
        out = scheduler.schedule()
        land_samples(scheduler, out, cfg.max_model_len)
        if step >= traffic.warmup_steps and out.rows:
            steps.append((out.num_tokens, len(out.rows)))
    return np.array(steps, np.int64).reshape(-1, 2)


def traffic_lengths(traffic: Traffic, max_model_len: int, rng: np.random.Generator, n: int):
    prompts = np.clip(rng.lognormal(np.log(traffic.prompt_median), traffic.prompt_sigma, n), 1, max_model_len // 2)
    outputs = rng.lognormal(np.log(traffic.output_median), traffic.output_sigma, n)
    return prompts.astype(int), np.clip(outputs, 1, max_model_len - 1 - prompts).astype(int)


def land_samples(scheduler: Scheduler, out, max_model_len: int) -> None:
    """What the engine does with a step's samples, minus the model: the sampled token lands, length finishes."""
    for row in out.rows:
        seq = row.seq
        if row.samples and not seq.finished:
            seq.token_ids[-1] = 0
            if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
                scheduler.finish(seq)


def pad_to(ladder, counts: np.ndarray) -> np.ndarray:
    ladder = np.sort(np.asarray(ladder))
    if len(counts) and counts.max() > ladder[-1]:
        raise ValueError(f"ladder {ladder.tolist()} does not cover a step of {counts.max()}")
    return ladder[np.searchsorted(ladder, counts)]


def padding_waste(ladder, counts: np.ndarray) -> float:
    """Share of the padded tokens (or rows) that are padding."""
    return float(1 - counts.sum() / pad_to(ladder, counts).sum())


def ladder_candidates(chosen: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The chosen ladder, each one-bucket-fewer and one-bucket-more (a midpoint) variant, and both extremes."""
    out = {"chosen": chosen, "single": chosen[-1:]}
    out |= {f"-{b}": tuple(x for x in chosen if x != b) for b in chosen[:-1]}
    mids = [m for a, b in zip(chosen, chosen[1:]) if (m := (a + b) // 2) not in chosen]
    out |= {f"+{m}": tuple(sorted(chosen + (m,))) for m in mids}
    every = tuple(sorted(set(range(chosen[0], chosen[-1], chosen[0])) | {chosen[-1]}))
    return out | ({} if every in out.values() else {f"every {chosen[0]}": every})


def bucket_model(sweep_rows: list[dict], field: str):
    """f(T): the mean `field` of the swept rows per token bucket, linear in between, flat outside."""
    ts = sorted({r["params"]["num_tokens"] for r in sweep_rows})
    ys = [np.mean([r[field] for r in sweep_rows if r["params"]["num_tokens"] == t]) for t in ts]
    return lambda x: np.interp(x, ts, ys)


def ladder_rows(sweep_rows: list[dict], steps: np.ndarray, chosen, seq_ladder, traffic: Traffic) -> list[dict]:
    """Rows `bench: "ladder"`: each candidate ladder's padding waste and modelled cost on the simulated steps."""
    step_ms, compile_s, code = (bucket_model(sweep_rows, f) for f in ("ms", "compile_s", "code_bytes"))
    tokens, seqs = steps[:, 0], steps[:, 1]
    ideal_ms = step_ms(tokens).mean()
    summary = {**dataclasses.asdict(traffic), "mean_tokens": float(tokens.mean()),
               "decode_only_frac": float(np.mean(tokens == seqs)), "seq_waste_frac": padding_waste(seq_ladder, seqs)}
    cost = {name: (float(step_ms(pad_to(ladder, tokens)).mean()), float(len(seq_ladder) * compile_s(ladder).sum()))
            for name, ladder in ladder_candidates(tuple(chosen)).items()}
    base_ms, base_compile = cost["chosen"]
    rows = []
    for name, ladder in ladder_candidates(tuple(chosen)).items():
        ms, comp = cost[name]
        saved, extra = base_ms - ms, comp - base_compile
        rows.append({"bench": "ladder", "impl": "jaxserve", "params": {"ladder": name, "token_buckets": list(ladder)},
                     "ms": ms, "tok_s": tokens.mean() / ms * 1e3, "token_waste_frac": padding_waste(ladder, tokens),
                     "time_waste_frac": 1 - ideal_ms / ms, "num_graphs": len(ladder) * len(seq_ladder),
                     "compile_s": comp, "code_bytes": float(len(seq_ladder) * code(ladder).sum()),
                     "saved_ms_per_step": saved, "extra_compile_s": extra,
                     "break_even_steps": extra * 1e3 / saved if extra * saved > 0 else None, "traffic": summary})
    return rows


# ---- plots --------------------------------------------------------------------------------------------------
def panel_of(row: dict, keys: tuple[str, ...]) -> tuple:
    return tuple(row["params"][k] for k in keys)


def plot_heatmaps(rows: list[dict], metric: str, panel_by: tuple[str, ...] = ("kind", "context")):
    """Heat maps of `metric` over (num_seqs, num_tokens), one panel per value of the `panel_by` params."""
    from matplotlib.figure import Figure
    panels = sorted({panel_of(r, panel_by) for r in rows})
    ts = sorted({r["params"]["num_tokens"] for r in rows})
    ss = sorted({r["params"]["num_seqs"] for r in rows})
    fig = Figure(figsize=(2.2 + 1.3 * len(ss) * len(panels), 1.2 + 0.45 * len(ts)), layout="constrained")
    for ax, panel in zip(np.atleast_1d(fig.subplots(1, len(panels))), panels):
        grid = np.full((len(ts), len(ss)), np.nan)
        for r in (r for r in rows if panel_of(r, panel_by) == panel):
            grid[ts.index(r["params"]["num_tokens"]), ss.index(r["params"]["num_seqs"])] = r[metric]
        ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
        for (i, j), v in np.ndenumerate(grid):
            if np.isfinite(v):
                ax.text(j, i, f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2g}", ha="center", va="center", fontsize=7,
                        color="w")
        ax.set(xticks=range(len(ss)), xticklabels=ss, yticks=range(len(ts)), yticklabels=ts, xlabel="num_seqs",
               ylabel="num_tokens", title=", ".join(f"{k} {v}" for k, v in zip(panel_by, panel)) or "every case")
    fig.suptitle(metric)
    return fig


def plot_ladder(steps: np.ndarray, chosen):
    """Tokens per simulated step, with the chosen ladder's buckets."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6, 3), layout="constrained")
    ax = fig.subplots()
    ax.hist(steps[:, 0], bins=64, color="tab:blue")
    for b in chosen:
        ax.axvline(b, color="tab:red", lw=1)
    ax.set(xlabel="tokens per step (red: token buckets)", ylabel="steps",
           title=f"simulated traffic: {padding_waste(chosen, steps[:, 0]):.0%} of padded tokens are padding")
    return fig


def save_plots(rows: list[dict], steps: np.ndarray, chosen, stem: pathlib.Path) -> list[pathlib.Path]:
    # one compile per bucket, whatever the case: compile_s gets a single panel
    figures = {m: plot_heatmaps(rows, m, () if m == "compile_s" else ("kind", "context")) for m in HEATMAP_METRICS}
    figures["ladder"] = plot_ladder(steps, chosen)
    paths = [stem.with_name(f"{stem.name}_{name}.png") for name in figures]
    for path, fig in zip(paths, figures.values()):
        fig.savefig(path, dpi=110)
    return paths


# ---- command line -------------------------------------------------------------------------------------------
def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML run config (configs/); default: the embedded SmolLM2")
    p.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q], default=None,
                   help="fp8: the linear layers' weights in FP8 (overrides the config)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None, help="overrides the config")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="overrides the config (None: the config's, else the model's context length)")
    p.add_argument("--token-buckets", type=int, nargs="+", default=None, help="default: the config's ladder")
    p.add_argument("--seq-buckets", type=int, nargs="+", default=None, help="default: the config's ladder")
    p.add_argument("--contexts", type=int, nargs="+", default=None, help="default: max_model_len / 8, / 2, x 1")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print each case's N costliest GPU kernels")
    defaults = Traffic()
    for name in ("prompt_median", "output_median", "load", "num_steps"):
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=type(getattr(defaults, name)),
                       default=getattr(defaults, name), help="simulated traffic for the ladder analysis")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/sweep_<backend>.json); "
                                               "PNGs go beside it as <stem>_<metric>.png")


def invocation(args) -> str:
    head = "jaxserve" if hasattr(args, "bench_command") else "python benchmarks/sweep.py"
    return " ".join([head, *map(shlex.quote, sys.argv[1:])])


def cmd_sweep(args) -> None:
    loaded, cfg = load_run(None, args.config, quantization=args.quantization)
    overrides = {"kv_cache_dtype": args.kv_cache_dtype, "max_model_len": args.max_model_len}
    cfg = fit_to_model(dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None}),
                       loaded.config.max_position_embeddings)
    rows = run_sweep(loaded, cfg, token_buckets=args.token_buckets, seq_buckets=args.seq_buckets,
                     contexts=args.contexts, kinds=args.kinds, warmup=args.warmup, repeats=args.repeats, seed=args.seed,
                     profile=args.profile)
    if not rows:
        raise ValueError("no bucket holds any case: decode needs num_seqs <= num_tokens")
    traffic = Traffic(prompt_median=args.prompt_median, output_median=args.output_median, load=args.load,
                      num_steps=args.num_steps)
    steps = simulate_steps(cfg, traffic, np.random.default_rng(args.seed))
    token_ladder, seq_ladder = bucket_ladders(cfg)
    rows += ladder_rows(rows, steps, token_ladder, seq_ladder, traffic)
    out = pathlib.Path(args.out or f"benchmarks/results/sweep_{jax.default_backend()}.json")
    write_rows(out, rows, invocation(args))
    for path in save_plots([r for r in rows if r["bench"] == "sweep"], steps, token_ladder, out.with_suffix("")):
        print(f"wrote {path}", file=sys.stderr)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    cmd_sweep(ap.parse_args(argv))


if __name__ == "__main__":
    main()
