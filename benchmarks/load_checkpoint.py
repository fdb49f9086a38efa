"""Checkpoint loading speed: a HF-layout safetensors checkpoint of a config's random_model shapes (bf16, sharded
into ~5 GB files like the Hub's) is written once, then loaded in the same run by
  - `read`:      every file read to memory (the disk or page-cache ceiling),
  - `raw`:       `safetensors.numpy.load_file` + `jax.device_put` of every tensor (the plain way),
  - `jaxserve`:  `jaxserve.models.loader.load_model` (each tensor read in file order by chunked preads on threads
                 while earlier ones are placed, layout and dtype fixed on the device, finiteness checked),
each from a cold page cache (the files' pages dropped with posix_fadvise after an fsync), again warm, and cold once
more: the first load in a process also pays its one-time costs (jaxserve: compiling its small layout and finiteness
graphs), the third is the streaming alone.

  python benchmarks/load_checkpoint.py --config configs/llama3-8b-random.yaml --dir /tmp/ckpt   # one H100
  python benchmarks/load_checkpoint.py --config configs/llama3-8b-random.yaml --dir /tmp/ckpt --layers 1  # CPU
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys
import time

import jax
import ml_dtypes
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import device_name, write_rows  # noqa: E402
from jaxserve.config import load_run_config, model_config_from_hf  # noqa: E402

FILE_BYTES = 5 << 30   # the Hub's usual shard size


def hf_tensors(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and stored shapes of a Llama checkpoint (Linear weights [out, in])."""
    h, d, q, kv, i = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    names = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        names += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                  (p + "self_attn.q_proj.weight", (q * d, h)), (p + "self_attn.k_proj.weight", (kv * d, h)),
                  (p + "self_attn.v_proj.weight", (kv * d, h)), (p + "self_attn.o_proj.weight", (h, q * d)),
                  (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                  (p + "mlp.down_proj.weight", (h, i))]
    return names + [("model.norm.weight", (h,)), ("lm_head.weight", (cfg.vocab_size, h))]


def write_checkpoint(raw_cfg: dict, cfg, out: pathlib.Path) -> list[pathlib.Path]:
    """bf16 tensors tiled from one random block (values do not change load speed), ~FILE_BYTES per file."""
    from safetensors.numpy import save_file
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw_cfg))
    block = (np.random.default_rng(0).standard_normal(1 << 22) * 0.02).astype(ml_dtypes.bfloat16)
    groups, group, size = [], {}, 0
    for name, shape in hf_tensors(cfg):
        group[name] = np.ones(shape, ml_dtypes.bfloat16) if len(shape) == 1 else np.resize(block, shape)
        size += group[name].nbytes
        if size >= FILE_BYTES:
            groups, group, size = groups + [group], {}, 0
    groups += [group] if group else []
    files = []
    for n, tensors in enumerate(groups, 1):
        files.append(out / f"model-{n:05d}-of-{len(groups):05d}.safetensors")
        save_file(tensors, files[-1])
        print(f"wrote {files[-1].name}", file=sys.stderr, flush=True)
    return files


def drop_page_cache(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def read_all(files) -> None:
    buf = bytearray(1 << 26)
    for f in files:
        with open(f, "rb") as fh:
            while fh.readinto(buf):
                pass


def raw_load(files) -> None:
    from safetensors.numpy import load_file
    arrays = []
    for f in files:
        arrays += [jax.device_put(w) for w in load_file(f).values()]
    jax.block_until_ready(arrays)


def jaxserve_load(directory) -> None:
    from flax import nnx

    from jaxserve.models.loader import load_model
    jax.block_until_ready(jax.tree.leaves(nnx.state(load_model(str(directory), "bf16").model)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a run config with a random_model section")
    p.add_argument("--dir", required=True, help="where the checkpoint is written (reused if present)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (small CPU runs)")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/load_checkpoint_<backend>.json)")
    args = p.parse_args()
    raw_cfg = dict(load_run_config(args.config).random_model)
    if args.layers:
        raw_cfg["num_hidden_layers"] = args.layers
    cfg, directory = model_config_from_hf(raw_cfg), pathlib.Path(args.dir)
    files = sorted(directory.glob("*.safetensors")) or write_checkpoint(raw_cfg, cfg, directory)
    total = sum(f.stat().st_size for f in files)
    rows = []
    for impl, load in (("read", lambda: read_all(files)), ("raw", lambda: raw_load(files)),
                       ("jaxserve", lambda: jaxserve_load(directory))):
        for n, cache in enumerate(("cold", "warm", "cold")):
            if cache == "cold":
                drop_page_cache(files)
            start = time.perf_counter()
            load()
            seconds = time.perf_counter() - start
            print(f"{impl:9s} {cache}{' (first)' if n == 0 else '':8s}: {seconds:6.2f} s, {total / seconds / 1e9:5.2f} GB/s", file=sys.stderr, flush=True)
            rows.append({"bench": "load_checkpoint", "impl": impl,
                         "params": {"config": args.config, "layers": cfg.num_layers, "page_cache": cache,
                                    "first_in_process": n == 0, "files": len(files), "bytes": total},
                         "ms": seconds * 1e3, "gbps": total / seconds / 1e9})
    backend = "h100" if "H100" in device_name() else jax.default_backend()
    write_rows(args.out or ROOT / "benchmarks" / "results" / f"load_checkpoint_{backend}.json", rows,
               shlex.join(["python", "benchmarks/load_checkpoint.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
