"""Offline throughput: N prompts x input_len random tokens, output_len tokens each (EOS ignored), greedy or
sampled (--temperature / --top-p / --top-k); `--shared-prefix-len` puts one common random prefix before every
prompt, `--n` samples each prompt n times.

Reports output tok/s, TTFT and TPOT, and the roofline for the workload from ceilings measured in the same run
(the memory bandwidth and the matmul rate, by the GPU's busy time): the prefill's FLOPs at the matmul rate,
then the decode steps in waves of as many sequences as run at once (max_num_seqs, or fewer where their whole
contexts do not fit the KV cache), each step its (weights + KV) bytes at the bandwidth or its FLOPs at the
matmul rate, whichever takes longer; TPOT beside one mid-run decode step's bound (`tpot_roofline_frac`: at
batch 1, the weight-read roofline); under tensor parallelism the bounds divide by the tp devices, each reading
and multiplying its shard. Prefix-once: the shared prefix and each prompt's input are read once a step for all
the sequences over them (prefilled once: the prefix cache); every-row (`roofline_every_row_s`): each sequence
reads its whole context itself, as plain attention does. `--set knob=value` overrides the config's engine
knobs.
`--peer transformers-cb` also runs HF transformers continuous batching on the same shapes. FP8 weights
(`--quantization fp8` or the config's) and an FP8 cache (`--set kv_cache_dtype=fp8`) count FP8's bytes and matmul
rate in the roofline.

  python benchmarks/offline.py --config configs/llama3-8b-random.yaml            # GPU
  python benchmarks/offline.py --config configs/llama3-8b-random.yaml --temperature 0.8 --top-p 0.95 --top-k 50
  python benchmarks/offline.py --config configs/llama3-8b-random.yaml --num-prompts 1 --input-len 128 \
      --output-len 512                                                          # GPU, batch-1 decode
  python benchmarks/offline.py --config configs/llama3-8b-random.yaml --shared-prefix-len 1024 --input-len 64 \
      --output-len 128                                                          # shared system prompt
  python benchmarks/offline.py --config configs/llama3-8b-random.yaml --num-prompts 32 --input-len 1024 --n 8 \
      --temperature 0.8                                                         # parallel sampling
  python benchmarks/offline.py --num-prompts 32 --input-len 128 --output-len 32  # CPU, embedded model
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import Bytes, linear_path_params, matmul_tflops, memory_bandwidth_gbps, write_rows  # noqa: E402

from jaxserve import LLM, RequestOutputKind, SamplingParams  # noqa: E402
from jaxserve.config import QUANTIZATIONS, load_run_config, model_config_from_hf  # noqa: E402
from jaxserve.models.loader import load_run  # noqa: E402


def weight_read_bytes(cfg, b: Bytes, rows: int = 1) -> float:
    """The weights a decode step of `rows` tokens reads: every linear layer (of a mixture of experts, the experts
    its tokens are routed to, uniform routing assumed) and the LM head (embeddings: one row per token)."""
    lm_head = cfg.vocab_size * cfg.hidden_size
    experts = cfg.expected_experts(rows) if cfg.num_experts else None
    unread = sum(cfg.mlp_params(i) - cfg.mlp_params(i, experts) for i in range(cfg.num_layers))
    linear = cfg.num_params - unread - lm_head * (1 if cfg.tie_word_embeddings else 2)
    return linear * b.linear + lm_head * b.other


@dataclass(frozen=True, slots=True)
class Workload:
    """num_prompts prompts of one shared prefix then input_len tokens of their own; n samples of output_len
    tokens each."""
    num_prompts: int
    input_len: int
    output_len: int
    shared_prefix_len: int = 0
    n: int = 1

    @property
    def prefill_tokens(self) -> int:
        """The tokens prefill computes: the shared prefix once (the prefix cache), each prompt's input once."""
        return self.shared_prefix_len + self.num_prompts * self.input_len

    def kv_tokens(self, j: int, prefix_once: bool = True) -> int:
        """The cached tokens decode step j reads. Prefix-once: the shared prefix once, each prompt's input once for
        its n samples, each sample's j outputs; else every sample its whole context."""
        if prefix_once:
            return self.shared_prefix_len + self.num_prompts * (self.input_len + self.n * j)
        return self.num_prompts * self.n * (self.shared_prefix_len + self.input_len + j)


def decode_step_bytes(cfg, kv_tokens, b: Bytes, rows: int = 1):
    """One decode step's least traffic: every weight it reads once, the K/V of kv_tokens cached tokens."""
    return weight_read_bytes(cfg, b, rows) + kv_tokens * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * b.kv


def matmul_params(cfg) -> float:
    """The weights a token is multiplied by: the linear layers (of a mixture of experts, the k it is routed to) and
    the LM head; the embedding is a lookup."""
    unread = sum(cfg.mlp_params(i) - cfg.mlp_params(i, cfg.num_experts_per_tok) for i in range(cfg.num_layers))
    return cfg.num_params - unread - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


@dataclass(frozen=True, slots=True)
class Ceilings:
    gbps: float     # memory bandwidth
    tflops: float   # the matmul rate of the linear layers' dtype (FP8 doubles bf16's)

    def step_s(self, nbytes: float, flops: float) -> float:
        return max(nbytes / (self.gbps * 1e9), flops / (self.tflops * 1e12))


def wave_prompts(w: Workload, max_seqs: int, kv_capacity: int) -> int:
    """The prompts decoding at once: max_seqs sequences, or fewer where their whole contexts (a prompt's input
    once for its n samples, the shared prefix once) would not fit kv_capacity tokens."""
    fit = (kv_capacity - w.shared_prefix_len) // (w.input_len + w.n * w.output_len)
    return max(1, min(w.num_prompts, max_seqs // w.n, fit))


def decode_step_s(cfg, wave: Workload, j: int, c: Ceilings, b: Bytes, prefix_once: bool = True) -> float:
    """Decode step j of a wave: its bytes at the bandwidth or its FLOPs at the matmul rate, whichever is longer
    (on an H200, 256 rows of a bf16 8B over a shared prefix are FLOP-bound)."""
    rows = wave.num_prompts * wave.n
    return c.step_s(decode_step_bytes(cfg, wave.kv_tokens(j, prefix_once), b, rows), 2 * matmul_params(cfg) * rows)


def roofline_s(cfg, w: Workload, c: Ceilings, b: Bytes, prompts: int, prefix_once: bool = True):
    """The prefill's FLOPs (the LM head only at each prompt's last token), then waves of `prompts` prompts
    decoding; a last partial wave counts as its share of a full one, which keeps the sum a lower bound."""
    wave = replace(w, num_prompts=prompts)
    decode = sum(decode_step_s(cfg, wave, j, c, b, prefix_once) for j in range(1, w.output_len))
    head = cfg.vocab_size * cfg.hidden_size
    prefill_flops = 2 * (matmul_params(cfg) - head) * w.prefill_tokens + 2 * head * w.num_prompts
    return decode * w.num_prompts / prompts + prefill_flops / (c.tflops * 1e12)


def override(engine_cfg, assignments):
    """--set knob=value (YAML values) over the config's engine knobs, checked like the config."""
    import dataclasses

    import yaml
    changes = {}
    for item in assignments:
        name, sep, value = item.partition("=")
        if not sep or name not in {f.name for f in dataclasses.fields(engine_cfg)}:
            raise SystemExit(f"--set {item!r}: expected KNOB=VALUE with an engine knob (see jaxserve/config.py)")
        changes[name] = yaml.safe_load(value)
    return dataclasses.replace(engine_cfg, **changes)


def run_jaxserve(loaded, engine_cfg, prompts, output_len, sampling: dict, n: int = 1):
    llm = LLM(loaded, config=engine_cfg)
    params = SamplingParams(**sampling, n=n, max_tokens=output_len, ignore_eos=True, seed=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)   # as LLM.generate: no output until done
    llm.generate(prompts[:min(8, len(prompts))], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)   # warm-up beyond precompile: first transfers, allocator
    engine = llm.engine
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    arrival = time.monotonic()
    first, done = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                first[out.request_id], done[out.request_id] = out.metrics["first_token_time"], time.monotonic()
    wall = time.perf_counter() - start
    ntok = len(prompts) * n * output_len
    ttft = np.array([first[r] - arrival for r in ids])
    tpot = np.array([(done[r] - first[r]) / max(output_len - 1, 1) for r in ids])
    return wall, ntok, ttft, tpot, engine.stats()


def run_transformers_cb(cfg, prompts, output_len):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    hf_cfg = LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, vocab_size=cfg.vocab_size,
                         max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
                         attn_implementation="sdpa")
    with torch.device("cuda"):
        model = LlamaForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    gen = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    model.generate_batch(prompts[:8], generation_config=gen, max_new_tokens=8)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen, max_new_tokens=output_len)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return wall, sum(len(o.generated_tokens) for o in out.values())


def make_prompts(cfg, args, seed: int = 0):
    """args.num_prompts prompts: one common prefix of args.shared_prefix_len random tokens (none if args has no
    such field), then args.input_len random tokens of each prompt's own."""
    rng = np.random.default_rng(seed)
    high = min(cfg.vocab_size, 128000)
    prefix = rng.integers(0, high, getattr(args, "shared_prefix_len", 0)).tolist()
    return [prefix + rng.integers(0, high, args.input_len).tolist() for _ in range(args.num_prompts)]


def run_peer_process(argv):
    import subprocess
    args = [a for a in (argv if argv is not None else sys.argv[1:])]
    out = subprocess.run([sys.executable, __file__, *args, "--peer-only"], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"transformers-cb peer failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--tensor-parallel-size", type=int, default=None, help="devices to split the model over "
                                                                           "(overrides the config)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--shared-prefix-len", type=int, default=0, help="random tokens every prompt starts with")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--set", nargs="+", default=[], metavar="KNOB=VALUE",
                    help="override engine knobs of the config, e.g. --set prefill_attention=mosaic seq_buckets=[256]")
    ap.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q], default=None,
                    help="fp8: the linear layers' weights in FP8 (the KV cache: --set kv_cache_dtype=fp8)")
    ap.add_argument("--peer", choices=["none", "transformers-cb"], default="none")
    ap.add_argument("--peer-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/offline_<device>.json)")
    args = ap.parse_args(argv)
    command = "python benchmarks/offline.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.peer != "none" and (args.shared_prefix_len or args.n != 1):
        raise SystemExit(f"--peer {args.peer} runs neither --shared-prefix-len nor --n: leave them at 0 and 1")
    if args.peer_only:   # a child process: torch cannot get GPU memory that JAX's allocator holds
        cfg = model_config_from_hf(load_run_config(args.config).random_model)
        print(json.dumps(run_transformers_cb(cfg, make_prompts(cfg, args), args.output_len)))
        return
    peer_result = run_peer_process(argv) if args.peer == "transformers-cb" else None
    loaded, engine_cfg = load_run(None, args.config, tensor_parallel_size=args.tensor_parallel_size,
                                  quantization=args.quantization)
    engine_cfg = override(engine_cfg, args.set)
    cfg = loaded.config
    prompts = make_prompts(cfg, args)
    ceilings = Ceilings(memory_bandwidth_gbps(),
                        matmul_tflops(jnp.float8_e4m3fn if loaded.quantization == "fp8" else jnp.bfloat16))
    dtype_bytes = Bytes.of(loaded, engine_cfg)
    tp = engine_cfg.tensor_parallel_size   # tp devices read and multiply in parallel: the bounds scale by tp
    work = Workload(args.num_prompts, args.input_len, args.output_len, args.shared_prefix_len, args.n)
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    wall, ntok, ttft, tpot, stats = run_jaxserve(loaded, engine_cfg, prompts, args.output_len, sampling, args.n)
    prompts_at_once = wave_prompts(work, engine_cfg.max_num_seqs, stats["kv_blocks_total"] * engine_cfg.block_size)
    roof = roofline_s(cfg, work, ceilings, dtype_bytes, prompts_at_once) / tp
    roof_every_row = roofline_s(cfg, work, ceilings, dtype_bytes, prompts_at_once, prefix_once=False) / tp
    wave = replace(work, num_prompts=prompts_at_once)
    tpot_roof_ms = decode_step_s(cfg, wave, args.output_len // 2, ceilings, dtype_bytes) * 1e3 / tp
    params = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "shared_prefix_len": args.shared_prefix_len, "n": args.n, **sampling,
              "seq_buckets": list(engine_cfg.seq_buckets or []),
              "prefill_attention": engine_cfg.prefill_attention, "set": args.set,
              "decode_attention": engine_cfg.decode_attention, "max_num_batched_tokens": engine_cfg.max_num_batched_tokens,
              "token_buckets": list(engine_cfg.token_buckets or []), "async_scheduling": engine_cfg.async_scheduling,
              "tensor_parallel_size": engine_cfg.tensor_parallel_size, "quantization": loaded.quantization,
              "kv_cache_dtype": engine_cfg.kv_cache_dtype, **linear_path_params(),
              **({"xla_flags": os.environ["XLA_FLAGS"]} if os.environ.get("XLA_FLAGS") else {}),
              "model": pathlib.Path(args.config).stem if loaded.source == "random" else loaded.source}
    rows = [{"bench": "offline", "impl": "jaxserve", "params": params, "ms": wall * 1e3, "tok_s": ntok / wall,
             "wall_s": wall, "roofline_s": roof, "roofline_frac": roof / wall,
             "roofline_every_row_s": roof_every_row, "roofline_every_row_frac": roof_every_row / wall,
             "memory_gbps": ceilings.gbps, "matmul_tflops": ceilings.tflops, "seqs_at_once": prompts_at_once * args.n,
             "ttft_p50_s": float(np.median(ttft)),
             "ttft_p99_s": float(np.quantile(ttft, .99)),
             "tpot_p50_ms": float(np.median(tpot) * 1e3), "tpot_p99_ms": float(np.quantile(tpot, .99) * 1e3),
             "tpot_roofline_ms": tpot_roof_ms, "tpot_roofline_frac": tpot_roof_ms / (np.median(tpot) * 1e3),
             "engine": stats}]
    print(f"jaxserve: {wall:.2f} s, {ntok / wall:.0f} output tok/s, roofline {roof:.2f} s ({roof / wall:.0%}; "
          f"every-row {roof_every_row:.2f} s: {roof_every_row / wall:.0%}), "
          f"TTFT p50 {rows[0]['ttft_p50_s']:.2f} s, TPOT p50 {rows[0]['tpot_p50_ms']:.1f} ms "
          f"(decode-step roofline {tpot_roof_ms:.1f} ms: {rows[0]['tpot_roofline_frac']:.0%}; "
          f"{prompts_at_once * args.n} sequences at once, ceilings {ceilings.gbps:.0f} GB/s, "
          f"{ceilings.tflops:.0f} TFLOP/s)", flush=True)
    out = args.out or f"benchmarks/results/offline_{jax.default_backend()}.json"
    write_rows(out, rows, command)
    if peer_result:
        peer_wall, peer_tok = peer_result
        peer = {"bench": "offline", "impl": "transformers-cb", "params": params, "ms": peer_wall * 1e3,
                "tok_s": peer_tok / peer_wall, "wall_s": peer_wall, "roofline_s": roof, "roofline_frac": roof / peer_wall}
        print(f"transformers-cb: {peer_wall:.2f} s, {peer_tok / peer_wall:.0f} output tok/s", flush=True)
        write_rows(out, [peer], command)


if __name__ == "__main__":
    main()
