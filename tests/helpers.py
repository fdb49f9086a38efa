"""Builders the test modules share: the tiny random model and engine knobs, request builders, the HF oracles, GGUF
files, the CLI, in-process servers, attention test batches and the vAttention checks. Test modules import these
from here, never from one another.

tests/multihost_worker.py and tests/tp_worker.py import some of these (through test_compilation) before they split
or join devices: nothing here may start a JAX backend at import time, and heavy packages (torch, transformers,
gguf, the server) are imported by the functions that use them.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig

if TYPE_CHECKING:
    from jaxserve import LLMEngine
    from jaxserve.serve.server import Server


# ---- the tiny random model and the engine knobs ---------------------------------------------------------------
# A 2-layer Llama with random weights (`random_model(TINY, jnp.float32)`): fast to compile, no tokenizer.
TINY_NO_EOS = ModelConfig(arch="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
TINY = dataclasses.replace(TINY_NO_EOS, eos_token_ids=(1,))   # stop ids under min_tokens mean something
# A small engine whose graphs all compile in seconds (two token buckets, two seq buckets).
KNOBS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, min_prefill_chunk=16,
             token_buckets=(16, 64), seq_buckets=(4, 8), compile_cache_dir=None)
# The engine behind the servers the serving tests start (in process or as `jaxserve serve`).
SERVER_KNOBS = dict(max_num_seqs=16, max_model_len=512, max_num_batched_tokens=128, num_blocks=256)


# ---- requests ----------------------------------------------------------------------------------------------------
def token_prompts(*lengths: int) -> list[list[int]]:
    """Token-id prompts of the given lengths, distinct from one another, ids in [2, 122) (never TINY's eos)."""
    return [[2 + (i * 7 + j) % 120 for j in range(n)] for i, n in enumerate(lengths)]


def mixed_requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """Every kind of request: greedy, sampled (top-k/p, min-p), penalties, logprobs, prompt logprobs, n > 1,
    stop ids under min_tokens, a long prompt (chunked prefill)."""
    params = [SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=1, max_tokens=12),
              SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, seed=2, max_tokens=12),
              SamplingParams(temperature=0.0, logprobs=3, max_tokens=12),
              SamplingParams(temperature=0.0, prompt_logprobs=2, max_tokens=4),
              SamplingParams(temperature=1.0, n=3, seed=3, max_tokens=12),
              SamplingParams(temperature=0.0, stop_token_ids=[5, 6, 7], min_tokens=4, max_tokens=12),
              SamplingParams(temperature=0.0, max_tokens=8)]
    return token_prompts(5, 17, 33, 9, 40, 3, 12, 200), params


# ---- HF transformers as the oracle (PyTorch CPU, same weights, f32) ---------------------------------------------
TEXT_PROMPTS = ["Hi", "The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,",
                "Once upon a time, in a land far away, there lived a dragon who",
                "Translate to French: I would like a cup of coffee, please.",
                "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
                "A long prompt " + "with many repeated words and numbers 1234 5678 " * 6]
# A tiny random checkpoint's transformers config (keyword arguments of LlamaConfig and its relatives).
TINY_HF_KWARGS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.1)


def forward_logits(loaded, ids):
    """All-position logits from the plain full-sequence forward (no cache)."""
    from flax import nnx
    fn = nnx.jit(lambda m, ids: m.logits(m(ids, jnp.arange(ids.shape[0]))[0]))
    return np.asarray(fn(loaded.model, jnp.asarray(ids, jnp.int32)))


def hf_logits(hf_model, ids):
    import torch
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].numpy()


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def greedy(loaded, ids, n):
    """Greedy decoding with the full forward, padded to one length so it compiles once."""
    from flax import nnx
    total = len(ids) + n
    fn = nnx.jit(lambda m, ids, last: m.logits(m(ids, jnp.arange(total))[0][last][None])[0].argmax())
    out = list(ids)
    for _ in range(n):
        padded = jnp.asarray(out + [0] * (total - len(out)), jnp.int32)
        out.append(int(fn(loaded.model, padded, len(out) - 1)))
    return out[len(ids):]


def hf_greedy(hf_model, ids, n):
    import torch
    ids = torch.tensor([ids])
    with torch.no_grad():   # an explicit mask: HF would otherwise mask prompt tokens equal to pad_token_id
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


# ---- GGUF files of an HF model's weights ------------------------------------------------------------------------
# Byte offsets of the fp16 super-block scales in each K-quant block (llama.cpp's ggml-common.h). gguf.quants
# cannot quantize to K-quants, so tests write random blocks whose scales are set small and finite.
K_QUANT_F16_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
HEADS, KV_HEADS = 4, 2   # of the llama GGUFs written here


def llama_cpp_permute(w, n_head):
    """What llama.cpp's converter does to q/k rows (interleaved rope); the loader must undo it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name):
    from jaxserve.models.gguf import GLOBAL_NAMES, TENSOR_NAMES
    for g, h in GLOBAL_NAMES.items():
        if h == hf_name:
            return g
    layer, suffix = hf_name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}." + next(g for g, h in TENSOR_NAMES.items() if h == suffix)


def llama_writer(path, cfg):
    """A GGUFWriter holding cfg's llama metadata."""
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, cfg.num_hidden_layers), (w.add_embedding_length, cfg.hidden_size),
                       (w.add_feed_forward_length, cfg.intermediate_size), (w.add_head_count, HEADS),
                       (w.add_head_count_kv, KV_HEADS), (w.add_context_length, 512),
                       (w.add_vocab_size, cfg.vocab_size), (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                       (w.add_rope_freq_base, cfg.rope_parameters["rope_theta"])):
        add(value)
    return w


def close_writer(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def encoded(x, kind, rng):
    """x as the bytes of GGML type kind; for a K-quant, random blocks of x's shape instead."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import quantize
    if kind.name not in K_QUANT_F16_SCALES:
        return quantize(x, kind)
    block_size, type_size = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (x.shape[0], x.shape[1] // block_size, type_size), np.uint8)
    for at in K_QUANT_F16_SCALES[kind.name]:
        scales = rng.uniform(1e-4, 1e-3, (*blocks.shape[:-1], 1)).astype(np.float16)
        blocks[..., at:at + 2] = scales.view(np.uint8)
    return blocks.reshape(x.shape[0], -1)


def write_gguf(path, hf, qtype):
    """Write hf's weights as a llama GGUF: matrices in qtype (a type name, or a function of the HF name giving
    one), norms F32. Return the weights a reader gets back, in HF order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    type_of = qtype if callable(qtype) else lambda name: qtype
    w, rng = llama_writer(path, hf.config), np.random.default_rng(0)
    stored = {}
    for name, t in hf.state_dict().items():
        x = t.numpy()
        n_head = HEADS if "q_proj" in name else KV_HEADS
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            x = llama_cpp_permute(x, n_head)
        kind = GGMLQuantizationType[type_of(name)] if x.ndim == 2 else GGMLQuantizationType.F32
        data = encoded(x, kind, rng)
        w.add_tensor(gguf_name(name), data, raw_dtype=None if kind == GGMLQuantizationType.F32 else kind)
        stored[name] = dequantize(data, kind).reshape(x.shape)
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # what an HF-layout reader must end up with
            stored[name] = stored[name].reshape(n_head, x.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2)
            stored[name] = stored[name].reshape(x.shape)
    close_writer(w)
    return stored


# ---- the command line ---------------------------------------------------------------------------------------------
# The CLI in an interpreter where torch cannot be found (as after `scripts/setup.sh` without --dev)
WITHOUT_TORCH = """import importlib.util, sys
hidden = lambda name: name.partition(".")[0] == "torch"
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if hidden(name) else find_spec(name, package)
class HideTorch:
    def find_spec(self, name, path=None, target=None):
        if hidden(name):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, HideTorch())
from jaxserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def jaxserve(*args, timeout=600, without_torch=False):
    """`jaxserve ARGS` in a subprocess (captured text output)."""
    entry = ["-c", WITHOUT_TORCH] if without_torch else ["-m", "jaxserve.cli"]
    return subprocess.run([sys.executable, *entry, *args], capture_output=True, text=True, timeout=timeout)


# ---- servers --------------------------------------------------------------------------------------------------------
MODEL, MODEL_ALIAS = "smollm2-135m-instruct", "smollm2"   # the in-process server's served names
IDLE_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_LOOP_IDS = itertools.count()


@contextlib.contextmanager
def in_process(engine, **opts):
    """A Server with an HTTP port on an event loop of its own thread (as `jaxserve serve` runs it), over an engine
    (on a thread of this process) or an EngineProcess."""
    from jaxserve.serve.engine_process import EngineProcess
    from jaxserve.serve.server import ServeOptions, Server
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=f"test-server-loop-{next(SERVER_LOOP_IDS)}", daemon=True)
    thread.start()
    call = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731

    async def start():
        engines = engine if isinstance(engine, EngineProcess) else [engine]
        server = Server(engines, ServeOptions(grpc_port=0, http_port=0, grace_period_s=1.0, **opts),
                        (MODEL, MODEL_ALIAS))
        await server.start()
        return server

    server = call(start())
    try:
        yield server
    finally:
        call(server.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def record_tokenize_threads(monkeypatch, threads: list[str]) -> None:
    """Every tokenize call, a front end's or an engine's, appends the name of the thread it runs on to threads."""
    from jaxserve import LLMEngine
    from jaxserve.serve.engine_loop import EngineFacts
    tokenize = LLMEngine.tokenize
    recorded = lambda *a, **k: threads.append(threading.current_thread().name) or tokenize(*a, **k)  # noqa: E731
    monkeypatch.setattr(LLMEngine, "tokenize", recorded)
    monkeypatch.setattr(EngineFacts, "tokenize", recorded)


def loop_thread_name(server: Server) -> str:
    """The thread running the server's event loop, unique per in_process server: its log records carry that name,
    and a server of an earlier test that still logs does not."""
    async def name() -> str:
        return threading.current_thread().name
    return asyncio.run_coroutine_threadsafe(name(), server.engine_loop.loop).result(10)


def base_url(server: Server) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def wait_idle(server: Server) -> dict:
    """Stats once nothing runs, waits or holds KV blocks (or the last seen, after IDLE_TIMEOUT_S)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        s = server.engine_loop.stats()
        if not (s["running"] or s["waiting"] or s["pending"] or s["kv_blocks_used"]) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


# ---- attention kernels' test batches ------------------------------------------------------------------------------
# The KV cache is NaN everywhere no live token was written, block-table entries past a sequence's end are garbage,
# and (on GPU) freed NaN buffers poison the allocator: reading anything unwritten, or leaving an output row
# unwritten, shows up as NaN. Padding rows must come out exactly zero.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def on_gpu() -> bool:
    """Whether JAX runs on a GPU (asked when called: importing this module must not start a backend)."""
    return jax.default_backend() == "gpu"


def on_hopper() -> bool:
    return on_gpu() and getattr(jax.devices()[0], "compute_capability", None) == "9.0"


def interpret_tuning() -> dict:
    """The kernels' tuning where they run in Pallas' interpreter (no GPU), which runs programs one by one: fewer
    decode programs (still several splits each), two splits of a cascade's shared keys."""
    return {} if on_gpu() else {"decode_programs": 16, "cascade_programs": 8}


@dataclass(slots=True)
class Batch:
    q: jax.Array
    k_cache: jax.Array
    v_cache: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    block_tables: jax.Array
    num_seqs: jax.Array
    live_tokens: int

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.cu_q_lens, self.kv_lens, self.block_tables,
                self.num_seqs)


GEOMETRY = {"q_heads": 8, "kv_heads": 2, "head_dim": 64, "block_size": 16, "max_seqs": 8, "num_tokens": 64,
            "max_blocks": 8, "num_blocks": 48}  # shared so one compile serves every mix
# (q_lens, kv_lens): decodes first (the engine's order), then chunked prefills; kv not multiples of 16.
MIXES = {
    "decodes": ([1, 1, 1, 1, 1], [1, 17, 40, 64, 99]),
    "prefill": ([45], [45]),
    "mixed": ([1, 1, 1, 13, 30, 7], [33, 5, 80, 13, 71, 50]),
    "decode_after_prefill": ([1, 9, 1, 1], [30, 40, 17, 64]),  # never from the engine; must still work
}


def make_batch(rng, q_lens, kv_lens, *, q_heads, kv_heads, head_dim, block_size, max_seqs, num_tokens, max_blocks,
               num_blocks, dtype=jnp.float32) -> Batch:
    """Random batch: sequences' pages in random order, NaN in every cache slot no live token wrote."""
    num_seqs, live_tokens = len(q_lens), sum(q_lens)
    pages = [-(-n // block_size) for n in kv_lens]
    assert num_seqs <= max_seqs and live_tokens <= num_tokens and max(pages) <= max_blocks < num_blocks
    order = iter(rng.permutation(np.arange(1, num_blocks)))
    tables = rng.integers(-5, 1 << 20, (max_seqs, max_blocks)).astype(np.int32)  # garbage past the end
    cache = np.full((2, num_blocks, block_size, kv_heads, head_dim), np.nan, np.float32)
    for i, n in enumerate(kv_lens):
        for j in range(pages[i]):
            tables[i, j] = next(order)
            filled = min(block_size, n - j * block_size)
            cache[:, tables[i, j], :filled] = rng.standard_normal((2, filled, kv_heads, head_dim))
    cu = np.full(max_seqs + 1, live_tokens, np.int32)
    cu[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    lens = rng.integers(1 << 20, 1 << 21, max_seqs).astype(np.int32)  # garbage past num_seqs
    lens[:num_seqs] = kv_lens
    q = rng.standard_normal((num_tokens, q_heads, head_dim)).astype(np.float32)
    return Batch(jnp.asarray(q, dtype), jnp.asarray(cache[0], dtype), jnp.asarray(cache[1], dtype),
                 jnp.asarray(cu), jnp.asarray(lens), jnp.asarray(tables), jnp.asarray([num_seqs], jnp.int32),
                 live_tokens)


def cached_as(batch: Batch, cache_dtype) -> Batch:
    """`batch` with its K and V caches stored as cache_dtype (None: as they are); NaN stays NaN (e4m3fn has one)."""
    if cache_dtype is None:
        return batch
    return dataclasses.replace(batch, k_cache=batch.k_cache.astype(cache_dtype),
                               v_cache=batch.v_cache.astype(cache_dtype))


def naive_attention(batch: Batch, *, sm_scale, sliding_window=None, soft_cap=None) -> np.ndarray:
    """Per-sequence dense attention in float64 numpy, written from the spec."""
    q, cu, kv_lens, tables = (np.asarray(x) for x in (batch.q.astype(jnp.float32), batch.cu_q_lens,
                                                        batch.kv_lens, batch.block_tables))
    k_cache, v_cache = (np.asarray(x.astype(jnp.float32), np.float64) for x in (batch.k_cache, batch.v_cache))
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = np.zeros(q.shape)
    for i in range(int(batch.num_seqs[0])):
        kv_len, qs = kv_lens[i], q[cu[i]:cu[i + 1]].astype(np.float64)
        pages = tables[i, : -(-kv_len // block_size)]
        k, v = (np.repeat(c[pages].reshape(-1, kv_heads, q.shape[2])[:kv_len], q.shape[1] // kv_heads, axis=1)
                for c in (k_cache, v_cache))
        s = np.einsum("qhd,khd->hqk", qs, k) * sm_scale
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        q_pos, key = kv_len - len(qs) + np.arange(len(qs)), np.arange(kv_len)
        mask = key[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= key[None, :] > q_pos[:, None] - sliding_window
        s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[cu[i]:cu[i + 1]] = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)
    return out


def check_close(out, expected, batch: Batch, dtype, label=""):
    """Live rows finite and within tolerance (max abs error / max abs value); padding rows exactly zero."""
    out = np.asarray(out.astype(jnp.float32))
    live = out[: batch.live_tokens]
    assert np.isfinite(live).all(), f"{label}: non-finite output in live rows"
    assert (out[batch.live_tokens:] == 0).all(), f"{label}: padding rows must be zeros"
    expected = np.asarray(expected, np.float64)[: batch.live_tokens]
    error = np.abs(live - expected).max() / np.abs(expected).max()
    assert error <= TOLERANCE[dtype], f"{label}: relative error {error:.3g} > {TOLERANCE[dtype]}"


def poison_allocator(batch: Batch):
    """On GPU, free a few NaN buffers of the output's size so an unwritten output row likely reads NaN."""
    if on_gpu():
        for _ in range(3):
            jnp.full(batch.q.shape, jnp.nan, batch.q.dtype).block_until_ready().delete()


# ---- vAttention: the page accounting against a counting model ----------------------------------------------------
class PageModel:
    """What the manager must do, by counting alone: live tokens per seq, the budget, the block tables."""

    def __init__(self, kv):
        self.kv, self.g = kv, kv.geometry
        self.tokens: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}

    def free_pages(self) -> int:
        return self.g.num_pages - self.kv.null_pages - sum(self.g.pages_for(n) for n in self.tokens.values())

    def admit_ok(self, n: int) -> bool:
        return len(self.tokens) < self.g.num_seqs and self.free_pages() - self.g.pages_for(n) >= \
            self.kv.watermark_pages

    def expected_row(self, n: int) -> set[int]:
        """Best fit: fewest mapped among free rows covering n's pages, else the most mapped."""
        kv, need = self.kv, self.g.pages_for(n)
        free = [s for s in range(1, self.g.rows) if s not in kv.live]
        fits = [s for s in free if kv.mapped[s] >= need]
        best = min(kv.mapped[s] for s in fits) if fits else max(kv.mapped[s] for s in free)
        return {s for s in (fits or free) if kv.mapped[s] == best}

    def apply_updates(self) -> None:
        for seq_id, start, ids in self.kv.take_block_updates():
            self.tables[seq_id] = self.tables.get(seq_id, [])[:start] + ids


def check_invariants(model: PageModel, mapper) -> None:
    from jaxserve.cache.vattention import FakePageMapper
    kv, g = model.kv, model.g
    if isinstance(mapper, FakePageMapper):   # every pool page in exactly one place: never double-mapped
        held = [p for pages in mapper.pages for p in pages] + mapper.free
        assert sorted(held) == list(range(g.num_pages))
    mapped = [mapper.num_mapped(s) for s in range(g.rows)]
    assert mapped == kv.mapped, "manager's view of mapped pages differs from the mapper's"
    assert sum(mapped) <= g.num_pages and kv.total_mapped == sum(mapped)
    assert mapped[0] >= kv.null_pages and 0 not in kv.live
    assert kv.num_free_pages == model.free_pages() >= 0
    slots = [kv.row_of(s) for s in model.tokens]
    assert len(set(slots)) == len(slots)
    assert sorted(kv.free_rows) == sorted(set(range(1, g.rows)) - set(slots))
    model.apply_updates()
    for seq_id, n in model.tokens.items():
        slot = kv.row_of(seq_id)
        assert kv.seqs[seq_id].num_computed == n
        assert mapped[slot] >= g.pages_for(n), "a live sequence's tokens are not all mapped"
        if isinstance(mapper, FakePageMapper):
            assert mapper.ready[slot] >= g.pages_for(n), "a step could touch a page still being mapped ahead"
        ids = [slot * g.blocks_per_row + i for i in range(-(-n // g.block_size))]   # the identity ids
        assert kv.block_ids(seq_id) == ids == model.tables[seq_id][:len(ids)]


def fuzz(kv, mapper, seed: int, steps: int = 400) -> dict:
    """Random admissions, growth and frees against the counting model, the invariants checked after each."""
    rng, model = np.random.default_rng(seed), PageModel(kv)
    seen, next_id = {"refused": 0, "reclaimed": 0, "reused": 0, "grow_refused": 0}, 0
    for _ in range(steps):
        op = rng.choice(["admit", "grow", "grow", "free"])
        if op == "admit" or not model.tokens:
            n = int(rng.integers(1, kv.geometry.max_model_len // 2))
            expect_ok, before = model.admit_ok(n), list(kv.mapped)
            candidates = model.expected_row(n) if len(model.tokens) < kv.geometry.num_seqs else set()
            ok, cached = kv.allocate(next_id, [7] * n, n)
            assert (ok, cached) == (expect_ok, 0), f"seed {seed}: admission of {n} tokens"
            if ok:
                assert kv.row_of(next_id) in candidates, f"seed {seed}: not the best-fit row"
                seen["reused"] += before[kv.row_of(next_id)] > 0
                model.tokens[next_id] = n
            else:
                seen["refused"] += 1
                assert kv.mapped == before and next_id not in kv.seqs
            next_id += 1
        elif op == "grow":
            seq_id = int(rng.choice(list(model.tokens)))
            old = model.tokens[seq_id]
            add = int(rng.integers(0, min(kv.geometry.max_model_len - old, 24) + 1))
            expect_ok = kv.geometry.pages_for(old + add) - kv.geometry.pages_for(old) <= model.free_pages()
            assert kv.allocate(seq_id, [7] * (old + add), add) == (expect_ok, 0), f"seed {seed}: growth"
            if expect_ok:
                model.tokens[seq_id] = old + add
            else:
                seen["grow_refused"] += 1
        else:   # finish or preempt: the same call
            seq_id = int(rng.choice(list(model.tokens)))
            kv.free(seq_id)
            del model.tokens[seq_id]
            with pytest.raises(KeyError):
                kv.free(seq_id)
        check_invariants(model, mapper)
    seen["reclaimed"] = sum(op == "trim" for op, *_ in getattr(mapper, "log", []))
    return seen


# ---- vAttention in the engine: outputs against paged mode, compiled graphs that never read the whole cache ------
PAGED = dict(enable_prefix_caching=False)   # the reference: the same schedule (vattention has no prefix hits)


def results(llm: LLM, prompts, params) -> list:
    """Every output of every request: tokens, logprobs, prompt logprobs (compared exactly)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [([(c.token_ids, c.logprobs) for c in o.outputs], o.prompt_logprobs) for o in outs]


def tokens(res: list) -> list:
    return [[ids for ids, _ in outs] for outs, _ in res]


def entry_params(compiled) -> list[str]:
    """The compiled graph's parameter shapes, as HLO writes them (s32[4,16]{1,0}, ...)."""
    header = compiled.as_text().split("\n", 1)[0]
    params = re.search(r"entry_computation_layout=\{\((.*?)\)->", header).group(1)
    return re.split(r", (?:/\*index=\d+\*/)?", params)


CACHE_OPS = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "call", "fusion", "scatter", "gather",
             "dynamic-slice", "dynamic-update-slice", "custom-call"}   # in-place writes, indexed reads, plumbing
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+|\(.*?\)) ([a-z][\w\-]*)\((.*)$")
ARRAY = re.compile(r"^[a-z]\w*\[([\d,]*)\]")


def whole_cache_ops(hlo: str, cache_size: int) -> set[str]:
    """Opcodes outside CACHE_OPS that produce or take an array of the cache's size (any shape: bitcasts reshape
    it), in every computation, fusions' insides included: a copy, a slice, an elementwise op, a reduction..."""
    bad, sizes = set(), {}
    for line in hlo.splitlines():
        if not (m := INSTRUCTION.match(line)):
            continue
        name, result, opcode, rest = m.groups()
        dims = ARRAY.match(result)
        sizes[name] = math.prod(int(d) for d in dims.group(1).split(",") if d) if dims else None
        operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
        if opcode not in CACHE_OPS and cache_size in [sizes[name]] + [sizes.get(o) for o in operands]:
            bad.add(opcode)
    return bad


def check_cache_untouched_whole(compiled, cache_struct) -> None:
    """The cache goes in and out aliased (donated: updated in place) and only CACHE_OPS touch arrays its size."""
    hlo, size = compiled.as_text(), math.prod(cache_struct.shape)
    header = hlo.split("\n", 1)[0]
    shape = re.escape(f"[{','.join(map(str, cache_struct.shape))}]")
    cache_params = [i for i, p in enumerate(entry_params(compiled)) if re.match(r"\w+" + shape, p)]
    aliased = {int(i) for i in re.findall(r"\(\s*(\d+), \{\}, (?:may|must)-alias\)", header)}
    assert cache_params and set(cache_params) <= aliased, f"cache parameters {cache_params} not aliased: {header}"
    assert not whole_cache_ops(hlo, size), whole_cache_ops(hlo, size)


def without_triton(monkeypatch) -> None:
    """A JAX without Pallas's Triton backend (deprecated since JAX 0.11), as the attention kernels see it: a Triton
    launch that still ran would fail on the missing module."""
    import importlib   # the package exports functions of these modules' names
    kernels, cascade = (importlib.import_module(f"pallas_kernels.{name}")
                        for name in ("ragged_paged_attention", "cascade_attention"))
    monkeypatch.setattr(kernels, "TRITON", False)
    monkeypatch.setattr(kernels, "plgpu", None)
    monkeypatch.setattr(cascade, "plgpu", None)
