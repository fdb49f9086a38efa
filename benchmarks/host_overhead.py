"""Host overhead of the paged KV cache: per-step decode bookkeeping, prefix lookup, batched copy-on-write; and of
streaming detokenization.

    .venv/bin/python benchmarks/host_overhead.py   # adds this run's rows to results/host_overhead.json

Rows (impl "jaxserve" unless named): decode_step = one decode step of `num_seqs` sequences at `context` tokens:
allocate 1 token each (every block_size-th step all of them take a new block and cache a full one), apply the block
updates to the persistent table, then build the step's attention inputs (`build_step_inputs`: slot mapping,
positions, cu_q_lens, kv_lens, gathered block-table rows; sampling rows left out).
Baseline "rebuild_table": the same with the block table rebuilt from every sequence's block list each step.
prefix_lookup = lookup_prefix of a cached `context`-token prompt with its block hashes precomputed (once per
request); hash_blocks = that one-time hashing. cow_copy = one copy_blocks call for 64 copy-on-write pairs
(Llama-3-8B KV shape) vs. baseline "per_seq_loop" (one call per pair). detokenize = one decode step's text for
`num_seqs` sequences, a token each, two stop strings (the embedded SmolLM2's tokenizer; `IncrementalDetokenizer`
through the tokenizers library's DecodeStream) vs. baseline "window_decodes" (the same through two transformers
decodes of a window a token).
"""
from __future__ import annotations

import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.common import commit  # noqa: E402
from jaxserve.cache.block_pool import extend_block_hashes  # noqa: E402
from jaxserve.cache.block_table import BlockTable  # noqa: E402
from jaxserve.cache import kv_cache  # noqa: E402
from jaxserve.cache.kv_cache import allocate_kv_cache, kv_bytes_per_block, pad_block_copies  # noqa: E402
from jaxserve.cache.kv_cache_manager import KVCacheManager  # noqa: E402
from jaxserve.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from jaxserve.engine.sampling_params import SamplingParams  # noqa: E402
from jaxserve.engine.step_inputs import build_step_inputs  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
NUM_SEQS, CONTEXT, BLOCK_SIZE, DECODE_STEPS = 256, 4096, 16, 1024
LOOKUP_CONTEXT, COW_PAIRS = 8192, 64
LLAMA3_8B_KV = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)


def timed(fn, repeats: int) -> np.ndarray:
    out = np.empty(repeats)
    for i in range(repeats):
        t0 = time.perf_counter()
        fn()
        out[i] = time.perf_counter() - t0
    return out * 1e3


def start_decode_batch(rng):
    max_blocks = (CONTEXT + DECODE_STEPS) // BLOCK_SIZE + 1
    manager = KVCacheManager(NUM_SEQS * max_blocks + 1, BLOCK_SIZE)
    table = BlockTable(NUM_SEQS, max_blocks)
    tokens = [rng.integers(0, 32000, CONTEXT).tolist() for _ in range(NUM_SEQS)]
    for seq, toks in enumerate(tokens):  # seq id == batch row
        assert manager.allocate(seq, toks, CONTEXT)[0]
    return manager, table, tokens


def update_table(manager: KVCacheManager, table: BlockTable, incremental: bool) -> None:
    updates = manager.take_block_updates()
    if incremental:
        for seq, start, block_ids in updates:
            table.write(seq, start, block_ids)
    else:
        for seq in range(NUM_SEQS):
            table.write(seq, 0, manager.block_ids(seq))


def bench_decode_step(incremental: bool) -> np.ndarray:
    manager, table, tokens = start_decode_batch(np.random.default_rng(0))
    rows = np.arange(NUM_SEQS, dtype=np.int32)
    ones = np.ones(NUM_SEQS, np.int32)

    def step():
        for seq, toks in enumerate(tokens):
            toks.append(7)  # the token sampled last step
            if not manager.allocate(seq, toks, 1)[0]:
                raise RuntimeError("benchmark pool too small")
        update_table(manager, table, incremental)
        manager.take_copies()
        return build_step_inputs(num_tokens=NUM_SEQS, num_seqs=NUM_SEQS, block_size=BLOCK_SIZE, scratch_slot=NUM_SEQS,
                                 block_tables=table.table[rows], starts=[len(t) - 1 for t in tokens], counts=ones,
                                 token_ids=ones, slots=rows)

    step()  # first step writes every row
    ms = timed(step, DECODE_STEPS - 2)
    last = step().model.attn.slot_mapping
    want = [manager.block_ids(s)[-1] * BLOCK_SIZE + (CONTEXT + DECODE_STEPS - 1) % BLOCK_SIZE for s in range(NUM_SEQS)]
    assert last.tolist() == want, "slot mapping diverged from the manager"
    return ms


def bench_prefix_lookup() -> tuple[np.ndarray, np.ndarray]:
    manager = KVCacheManager(LOOKUP_CONTEXT // BLOCK_SIZE + 2, BLOCK_SIZE, watermark=0)
    prompt = np.random.default_rng(1).integers(0, 32000, LOOKUP_CONTEXT).tolist()
    manager.allocate("warm", prompt, LOOKUP_CONTEXT)
    manager.free("warm")
    hash_ms = timed(lambda: extend_block_hashes([], prompt, BLOCK_SIZE), 50)
    memo = extend_block_hashes([], prompt, BLOCK_SIZE)
    want = (LOOKUP_CONTEXT - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert manager.lookup_prefix(prompt, block_hashes=memo) == want
    return timed(lambda: manager.lookup_prefix(prompt, block_hashes=memo), 500), hash_ms


def bench_cow_copy() -> tuple[np.ndarray, np.ndarray, int, int]:
    manager = KVCacheManager(4 * COW_PAIRS + 1, BLOCK_SIZE, watermark=0)
    prompt = list(range(BLOCK_SIZE // 2))  # a partial block, shared after the fork
    for p in range(COW_PAIRS):
        manager.allocate(p, prompt, len(prompt))
        manager.fork(p, ("child", p))
        manager.allocate(p, prompt + [1], 1)  # the parent writes first: copy-on-write
    src, dst = manager.take_copies()
    assert len(src) == COW_PAIRS
    cache = allocate_kv_cache(num_blocks=4 * COW_PAIRS + 1, block_size=BLOCK_SIZE, **LLAMA3_8B_KV)

    def copy(cache, src, dst):   # as the runner copies: ids padded to a bucket, one device call
        return kv_cache.copy_blocks(cache, *pad_block_copies(src, dst, 4 * COW_PAIRS + 1))

    def batched():
        nonlocal cache
        cache = copy(cache, src, dst)
        jax.block_until_ready(cache)

    def per_seq():
        nonlocal cache
        for i in range(COW_PAIRS):
            cache = copy(cache, src[i:i + 1], dst[i:i + 1])
        jax.block_until_ready(cache)

    batched(), per_seq()  # compile
    calls = count_device_calls(batched)
    return timed(batched, 20), timed(per_seq, 5), calls, kv_bytes_per_block(block_size=BLOCK_SIZE, **LLAMA3_8B_KV)


class WindowDecodes:
    """A tokenizer seen through its decode only: IncrementalDetokenizer then decodes windows itself."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def embedded_tokenizer():
    from gguf import GGUFReader
    from jaxserve.models.gguf import gguf_tokenizer
    from jaxserve.models.loader import DEFAULT_MODEL, embedded_model_path
    path = embedded_model_path(DEFAULT_MODEL)
    return gguf_tokenizer(GGUFReader(path), path)


def bench_detokenize(tokenizer, ids: list[int], steps: int = 64) -> np.ndarray:
    """ms a step for NUM_SEQS sequences taking one token each of ids (prose, so some steps end words and some do
    not)."""
    params = SamplingParams(stop=["\n\n", "THE END"])
    seqs = [IncrementalDetokenizer(tokenizer, ids[:16], params) for _ in range(NUM_SEQS)]
    times = []
    for step in range(steps):
        token = [ids[16 + step]]
        start = time.perf_counter()
        for seq in seqs:
            seq.update(token)
        times.append((time.perf_counter() - start) * 1e3)
    return np.asarray(times)


def count_device_calls(fn) -> int:
    """Executions of the jitted copy kernel (each one XLA launch) while fn runs."""
    real, calls = kv_cache.copy_blocks, 0

    def counting(*args):
        nonlocal calls
        calls += 1
        return real(*args)

    kv_cache.copy_blocks = counting
    try:
        fn()
    finally:
        kv_cache.copy_blocks = real
    return calls


def device_name() -> str:
    """Host rows measure the CPU, so a GPU run names its host CPU too."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown")
    dev = jax.devices()[0]
    return f"cpu: {cpu}" if dev.platform == "cpu" else f"{dev.platform}: {dev.device_kind} (host cpu: {cpu})"


def row(impl, params, ms, **metric):
    """ms is the median; mean and max show the steps where every sequence takes a new block at once."""
    return {"bench": "host_overhead", "impl": impl, "params": params, "ms": round(float(np.median(ms)), 5),
            "ms_mean": round(float(ms.mean()), 5), "ms_max": round(float(ms.max()), 5), **metric,
            "device": device_name(),
            "jax": jax.__version__, "commit": commit(), "command": "python benchmarks/host_overhead.py"}


def main():
    params = {"num_seqs": NUM_SEQS, "context": CONTEXT, "block_size": BLOCK_SIZE}
    rows = []
    for impl, incremental in (("jaxserve", True), ("rebuild_table", False)):
        ms = bench_decode_step(incremental)
        rows.append(row(impl, {**params, "op": "decode_step"}, ms, tok_s=round(NUM_SEQS / np.median(ms) * 1e3)))
    lookup_ms, hash_ms = bench_prefix_lookup()
    lookup = {"num_seqs": 1, "context": LOOKUP_CONTEXT, "block_size": BLOCK_SIZE}
    rows.append(row("jaxserve", {**lookup, "op": "prefix_lookup"}, lookup_ms,
                    tok_s=round(LOOKUP_CONTEXT / np.median(lookup_ms) * 1e3)))
    rows.append(row("jaxserve", {**lookup, "op": "hash_blocks"}, hash_ms,
                    tok_s=round(LOOKUP_CONTEXT / np.median(hash_ms) * 1e3)))
    cow_ms, loop_ms, calls, block_bytes = bench_cow_copy()
    cow = {"num_seqs": COW_PAIRS, "context": BLOCK_SIZE // 2, "block_size": BLOCK_SIZE, "op": "cow_copy",
           "kv_shape": "llama3-8b bf16", "device_calls": calls}
    moved = 2 * COW_PAIRS * block_bytes  # read + write
    rows.append(row("jaxserve", cow, cow_ms, gbps=round(moved / np.median(cow_ms) / 1e6, 2)))
    rows.append(row("per_seq_loop", {**cow, "device_calls": COW_PAIRS}, loop_ms,
                    gbps=round(moved / np.median(loop_ms) / 1e6, 2)))
    tokenizer = embedded_tokenizer()
    detok = {"num_seqs": NUM_SEQS, "op": "detokenize", "tokenizer": "SmolLM2-135M (byte-level BPE)"}
    ids = tokenizer.encode("Once upon a time, a small fox lived by the river; it ate berries, 12 of them a day, "
                           "and told the herons (who did not listen) about the weather in the hills. " * 8)
    for impl, tok in (("jaxserve", tokenizer), ("window_decodes", WindowDecodes(tokenizer))):
        ms = bench_detokenize(tok, ids)
        rows.append(row(impl, detok, ms, tok_s=round(NUM_SEQS / np.median(ms) * 1e3)))
    out = ROOT / "benchmarks" / "results" / "host_overhead.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(kept + rows, indent=1) + "\n")
    for r in rows:
        print(f"{r['impl']:>14} {r['params']['op']:>14}: median {r['ms']:.4f} ms, mean {r['ms_mean']:.4f}, "
              f"max {r['ms_max']:.4f}")


if __name__ == "__main__":
    main()
