"""vAttention (issue #20) beside paged mode, the same model, knobs and workloads in the same run.

  python benchmarks/vattention.py engine --backend paged --config configs/llama3-8b-random.yaml
  python benchmarks/vattention.py engine --backend contiguous --config configs/llama3-8b-random.yaml
  python benchmarks/vattention.py engine --backend identity --config configs/llama3-8b-random.yaml
  python benchmarks/vattention.py kernels        # decode attention at 64 and 256 x 4096, one layer

`engine` (one backend a process: an illegal address on one must not take the others' rows): offline 256 x
512/128, decode at 64 x 4096 (TPOT: the decode steps' time), prefill 1 x 8191 (TTFT; its token makes the model's
8192 positions), each run once to warm up, then measured. Per workload: host time per step (schedule + step
inputs + launch: `LLMEngine.launch_step`), of it the block-table work (table writes and row gathers) and the
synchronous page maps (a step cannot launch before its pages are mapped; look-ahead maps run on the mapper
thread), and how much of those maps was exposed (on the device's critical path: `count_exposed_maps`); and the KV
capacity the same memory gives (tokens, and sequences of the workload's length: the cross-layer cache's 2 MiB
page holds 32 tokens of every layer of Llama-3-8B, so a vattention sequence takes its tokens rounded up to 32).
Prefix caching is off in both (vattention has none): the same schedule.
`kernels`: the engine's decode kernel over a paged cache (shuffled blocks), its contiguous variant (rows by
slot, stage 2) on one layer's rows, and on a layer of the cross-layer cache the engine runs (blocks num_layers
apart, rows an odd number of pages apart as VAttentionGeometry lays them out; 16 layers at batch 64, 4 at 256, for
memory: Llama-3-8B has 32), and cuDNN (`jax.nn.dot_product_attention`) on the dense [B, ctx, kv, d] layout a
one-layer row is (the "unmodified kernel"); 256 x 4096 is past what the 8B model's KV fits beside its weights on
an H100.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # vattention's pool lives beside XLA's; paged
                                                                   # is sized from the same allocator limit
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import time_ms, write_rows  # noqa: E402
from benchmarks.offline import override  # noqa: E402

BACKENDS = {"paged": {},
            "contiguous": dict(kv_backend="vattention", vattention_kernels="contiguous"),
            "identity": dict(kv_backend="vattention", vattention_kernels="identity")}
KNOBS = ["max_model_len=8192", "enable_prefix_caching=false", "token_buckets=[256,1024,4096]",
         "seq_buckets=[64,256]"]   # the ladder these workloads use: fewer graphs to compile three times
WORKLOADS = {"offline_256x512/128": (256, 512, 128), "decode_64x4096": (64, 4096, 128),
             "prefill_1x8191": (1, 8191, 1)}


class Timer:
    """Seconds spent inside wrapped callables, and their calls."""

    def __init__(self):
        self.seconds, self.calls, self.last_wait = {}, {}, 0.0

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def timed(*args, **kw):
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed

    def reset(self):
        self.seconds.clear()
        self.calls.clear()


# A step whose launch ended this long or more before the previous step's results came back launched while the
# device was still busy: its synchronous maps were off the critical path. Otherwise they count as exposed.
BUSY_DEVICE_S = 50e-6


def instrument(engine) -> Timer:
    timer, runner = Timer(), engine.runner
    engine.launch_step = timer.wrap("launch", engine.launch_step)
    engine.complete_step = wait_then(engine.complete_step, timer)
    engine.step = count_exposed_maps(engine.step, timer)
    runner.block_table.write = timer.wrap("block_table", runner.block_table.write)
    runner.kv_addressing = timer.wrap("block_table", runner.kv_addressing)
    if (mapper := getattr(engine.kv, "mapper", None)) is not None:   # vattention: time its page maps
        for name in ("map", "map_ahead", "trim"):
            setattr(mapper, name, timer.wrap(name, getattr(mapper, name)))
    return timer


def wait_then(complete, timer: Timer):
    """complete_step, the wait for the step's results timed apart (async scheduling: the previous step's)."""
    @functools.wraps(complete)
    def timed(launched):
        start = time.perf_counter()
        if launched is not None:
            jax.block_until_ready(launched.out)
        timer.last_wait = time.perf_counter() - start
        return complete(launched)
    return timed


def count_exposed_maps(step, timer: Timer):
    """engine.step, its synchronous map time counted as exposed (on the device's critical path) unless the step
    launched while the device was still busy with the previous one (BUSY_DEVICE_S)."""
    @functools.wraps(step)
    def counted():
        before = timer.seconds.get("map", 0.0)
        timer.last_wait = 0.0
        out = step()
        if timer.last_wait < BUSY_DEVICE_S:
            exposed = timer.seconds.get("map", 0.0) - before
            timer.seconds["map_exposed"] = timer.seconds.get("map_exposed", 0.0) + exposed
        return out
    return counted


def run_workload(llm, timer: Timer, num_prompts: int, input_len: int, output_len: int, vocab: int) -> dict:
    from jaxserve import SamplingParams
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, min(vocab, 128000), input_len).tolist() for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine = llm.engine
    timer.reset()
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first, done, steps = {}, {}, 0
    while engine.has_unfinished_requests():
        outs, steps = engine.step(), steps + 1
        now = time.perf_counter()
        for out in outs:
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
    wall = time.perf_counter() - start
    ttft = np.array([first[r] - start for r in ids])
    tpot = np.array([(done[r] - first[r]) / max(output_len - 1, 1) for r in ids])
    per_step = {k: v / steps * 1e3 for k, v in timer.seconds.items()}
    return {"ms": wall * 1e3, "tok_s": num_prompts * output_len / wall, "steps": steps,
            "step_ms": wall / steps * 1e3, "ttft_p50_s": float(np.median(ttft)),
            "tpot_p50_ms": float(np.median(tpot) * 1e3), "host_ms_per_step": per_step.get("launch", 0.0),
            "block_table_ms_per_step": per_step.get("block_table", 0.0),
            "map_ms_per_step": per_step.get("map", 0.0), "map_ahead_ms_per_step": per_step.get("map_ahead", 0.0),
            "trim_ms_per_step": per_step.get("trim", 0.0), "maps": timer.calls.get("map", 0),
            "map_frac_of_step": per_step.get("map", 0.0) / (wall / steps * 1e3),
            "map_exposed_ms_per_step": per_step.get("map_exposed", 0.0),
            "map_exposed_frac_of_step": per_step.get("map_exposed", 0.0) / (wall / steps * 1e3),
            "preemptions": engine.scheduler.num_preemptions}


def capacity(engine, seq_tokens: int) -> dict:
    kv = engine.kv
    if getattr(kv, "geometry", None) is None:   # paged
        tokens = (kv.num_blocks - 1) * kv.block_size
        return {"kv_tokens": tokens, "seqs_that_fit": tokens // (-(-seq_tokens // kv.block_size) * kv.block_size)}
    g = kv.geometry
    return {"kv_tokens": kv.usable_pages * g.page_size // g.token_bytes,
            "seqs_that_fit": kv.usable_pages // g.pages_for(seq_tokens)}


def bench_engine(args, command: str) -> None:
    from jaxserve import LLM
    from jaxserve.models.loader import load_run
    loaded, cfg = load_run(None, args.config)
    knobs = KNOBS + [f"{k}={str(v).lower()}" for k, v in BACKENDS[args.backend].items()] + args.set
    cfg = override(cfg, knobs)
    start = time.perf_counter()
    llm = LLM(loaded, config=cfg)
    start_s = time.perf_counter() - start
    timer, rows = instrument(llm.engine), []
    for name, (n, i, o) in WORKLOADS.items():
        if args.workloads and name not in args.workloads:
            continue
        run_workload(llm, timer, min(n, 8), i, min(o, 4), loaded.config.vocab_size)   # warm-up
        res = run_workload(llm, timer, n, i, o, loaded.config.vocab_size)
        res |= capacity(llm.engine, i + o)
        params = {"workload": name, "num_prompts": n, "input_len": i, "output_len": o, "set": knobs}
        rows.append({"bench": "vattention_engine", "impl": args.backend, "params": params, **res,
                     "engine_start_s": start_s, "compiles_after_start": llm.engine.stats()["compiles_after_start"]})
        print(f"{args.backend:10s} {name:20s} {res['tok_s']:8.0f} tok/s  TTFT p50 {res['ttft_p50_s']:.3f} s  "
              f"TPOT p50 {res['tpot_p50_ms']:.2f} ms  host {res['host_ms_per_step']:.2f} ms/step (table "
              f"{res['block_table_ms_per_step']:.3f}, map {res['map_ms_per_step']:.3f} = "
              f"{res['map_frac_of_step']:.2%} of a step, exposed {res['map_exposed_frac_of_step']:.2%})  "
              f"{res['kv_tokens']:,} KV tokens, "
              f"{res['seqs_that_fit']} seqs fit", flush=True)
    write_rows(args.out, rows, command)


def decode_batch(batch: int, context: int, kv_heads=8, q_heads=32, head_dim=128, block_size=16):
    """A decode step's q and one layer's cache both ways: paged (blocks shuffled) and as vattention rows."""
    blocks_per_seq = context // block_size
    keys = jax.random.split(jax.random.key(0), 3)
    rows = [jax.random.normal(k, (batch, context, kv_heads, head_dim), jnp.bfloat16) for k in keys[:2]]
    q = jax.random.normal(keys[2], (batch, q_heads, head_dim), jnp.bfloat16)
    perm = np.random.default_rng(0).permutation(batch * blocks_per_seq)   # block p of the pool = perm's index
    table = np.empty(batch * blocks_per_seq, np.int32)
    table[perm] = np.arange(batch * blocks_per_seq)
    paged = [r.reshape(-1, block_size, kv_heads, head_dim)[jnp.asarray(perm)] for r in rows]
    return q, rows, paged, jnp.asarray(table.reshape(batch, blocks_per_seq))


def cross_layer_rows(rows: jax.Array, num_layers: int, layer: int, row_blocks: int) -> jax.Array:
    """rows [B, ctx, kv, d] as `layer` of a cross-layer cache [B * row_blocks, num_layers, 16, kv, d] (zeros
    elsewhere), viewed as the kernels take it: [B * row_blocks * num_layers, 16, kv, d]."""
    batch, context = rows.shape[:2]
    blocks = rows.reshape(batch, context // 16, 16, *rows.shape[2:])
    shape = (batch, row_blocks, num_layers, *blocks.shape[2:])
    cache = jax.jit(lambda b: jnp.zeros(shape, b.dtype).at[:, :context // 16, layer].set(b))(blocks)   # one buffer
    return cache.reshape(-1, *blocks.shape[2:])


def bench_kernels(args, command: str) -> None:
    from pallas_kernels import contiguous_ragged_attention, ragged_paged_attention
    rows_out = []
    for batch, num_layers in ((64, 16), (256, 4)):   # 8 GiB each of K and V
        context, scale, bps = 4096, 128 ** -0.5, 4096 // 16
        q, rows, paged, table = decode_batch(batch, context)
        cu, lens = jnp.arange(batch + 1, dtype=jnp.int32), jnp.full(batch, context, jnp.int32)
        n, slots = jnp.array([batch], jnp.int32), jnp.arange(batch, dtype=jnp.int32)
        cross_bps = bps + 2   # VAttentionGeometry: 4,096 tokens are 128 pages of 32, and rows are laid an odd number apart
        cross = [cross_layer_rows(r, num_layers, num_layers // 2, cross_bps) for r in rows]
        calls = {   # name -> (fn, its arrays: arguments, never constants folded into the graph)
            "paged": (lambda q, k, v, t: ragged_paged_attention(q, k, v, cu, lens, t, n, sm_scale=scale,
                                                                decode_only=True), (q, *paged, table)),
            "contiguous": (lambda q, k, v, s: contiguous_ragged_attention(
                q, k.reshape(-1, 16, 8, 128), v.reshape(-1, 16, 8, 128), cu, lens, s, n, blocks_per_row=bps,
                sm_scale=scale, decode_only=True), (q, *rows, slots)),
            "contiguous-cross-layer": (lambda q, k, v, s, layer: contiguous_ragged_attention(
                q, k, v, cu, lens, s, n, blocks_per_row=cross_bps, num_layers=num_layers, layer=layer,
                sm_scale=scale, decode_only=True), (q, *cross, slots, jnp.int32(num_layers // 2))),
            "cudnn": (lambda q, k, v: jax.nn.dot_product_attention(
                q[:, None], k, v, scale=scale, implementation="cudnn", query_seq_lengths=jnp.ones(batch, jnp.int32),
                key_value_seq_lengths=lens)[:, 0], (q, *rows))}
        fns = {name: jax.jit(fn) for name, (fn, _) in calls.items()}
        outs = {name: np.asarray(fns[name](*a), np.float32) for name, (_, a) in calls.items()}
        kv_bytes = 2 * batch * context * 8 * 128 * 2
        for name, (_, arrays) in calls.items():
            err = float(np.abs(outs[name] - outs["paged"]).max())
            assert np.isfinite(outs[name]).all() and err < 2e-2, f"{name}: max |diff| {err} vs paged"
            ms = time_ms(fns[name], *arrays, warmup=3, repeats=20)
            rows_out.append({"bench": "vattention_decode_kernel", "impl": name, "ms": ms,
                             "gbps": kv_bytes / ms / 1e6, "max_abs_diff_vs_paged": err,
                             "params": {"batch": batch, "context": context, "kv_heads": 8, "q_heads": 32,
                                        "head_dim": 128, "dtype": "bfloat16",
                                        **({"num_layers": num_layers} if "cross" in name else {})}})
            print(f"decode {batch} x {context} {name:22s} {ms:.3f} ms {kv_bytes / ms / 1e6:,.0f} GB/s", flush=True)
        del q, rows, paged, cross, calls
    write_rows(args.out, rows_out, command)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["engine", "kernels"])
    ap.add_argument("--backend", choices=list(BACKENDS), default="paged")
    ap.add_argument("--config", default="configs/llama3-8b-random.yaml")
    ap.add_argument("--workloads", nargs="*", choices=list(WORKLOADS), default=None)
    ap.add_argument("--set", nargs="*", default=[], metavar="KNOB=VALUE", help="more engine knobs")
    ap.add_argument("--out", default="benchmarks/results/vattention_h100.json")
    args = ap.parse_args(argv)
    command = "python benchmarks/vattention.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (bench_engine if args.what == "engine" else bench_kernels)(args, command)


if __name__ == "__main__":
    main()
