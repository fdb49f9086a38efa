"""No graph compiles while serving: every graph compiles before the engine serves, whatever the mix of requests,
and a warm restart takes them all from the persistent compilation cache (CPU, a tiny random model)."""
import functools
import json
import os
import subprocess
import sys
import textwrap
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.cache import kv_cache
from jaxserve.engine.compilation import CompilationManager, ExecutableCache
from jaxserve.engine.step_graphs import PEAK, TRITON_GEMM_MAX_ROWS, GraphKey, StepGraphs
from jaxserve.engine.sampling_params import MAX_LOGPROBS
from jaxserve.models.fp8 import W8A16_MAX_ROWS
from jaxserve.models.loader import random_model

from conftest import XLA_CACHE_ENV
from helpers import KNOBS, TINY, mixed_requests   # tests/multihost_worker.py and tp_worker.py import them from here


@pytest.mark.parametrize("knobs", [dict(num_blocks=128), dict(num_blocks=22)], ids=["roomy", "preempting"])
def test_no_graph_compiles_after_start_whatever_the_requests(knobs):
    llm = LLM(random_model(TINY, jnp.float32), **KNOBS, **knobs)
    compiled = llm.engine.stats()["compiled_graphs"]
    prompts, params = mixed_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    outs += llm.generate(prompts[:1] * 6, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # copies
    stats = llm.engine.stats()
    assert all(o.finished for o in outs) and outs[4].prompt_logprobs[1] is not None
    assert stats["compiles_after_start"] == 0 and stats["compiled_graphs"] == compiled
    if knobs["num_blocks"] == 22:
        assert stats["preemptions"] > 0


@pytest.fixture
def sized_start(monkeypatch):
    """Starts that size the cache from the activation peak (num_blocks None; 64 blocks whatever the peak), seen
    through hooks: the graphs submitted (in order, and how many before the cache was sized), each compile's key
    and the peak."""
    seen = {"submitted": [], "compiled": []}
    submit, compile_ = CompilationManager.submit, CompilationManager._compile

    def sized(bytes_per_block, *, activation_peak_bytes, fraction, device):
        seen.update(peak=activation_peak_bytes, submitted_before_sizing=list(seen["submitted"]))
        return 64

    def submitted(self, graphs, **kw):
        seen["submitted"].extend(key for key in graphs if key not in seen["submitted"])
        return submit(self, graphs, **kw)

    def compiled(self, key, lowered):
        seen["compiled"].append(key)
        return compile_(self, key, lowered)
    monkeypatch.setattr(kv_cache, "num_blocks_for_memory", sized)
    monkeypatch.setattr(CompilationManager, "submit", submitted)
    monkeypatch.setattr(CompilationManager, "_compile", compiled)
    return lambda **knobs: (LLM(random_model(TINY, jnp.float32), **{**KNOBS, "num_blocks": None, **knobs}), seen)


PEAK_KEYS = [PEAK, GraphKey("sampler", (8, "filter", MAX_LOGPROBS, True, 1)), GraphKey("prompt", (64,))]


def compiled_peak(graphs: StepGraphs) -> int:
    """The activation peak of the peak's graphs compiled here, apart from the start's compilation manager (with the
    XLA options the start gives each: on a GPU they change the model's temp memory): the largest bucket's model on a
    2-block stand-in cache, sampler (filter, logprobs) and prompt logprobs."""
    return sum(graphs.lower(key).compile(graphs.compiler_options(key) or None).memory_analysis().temp_size_in_bytes
               for key in PEAK_KEYS)


def test_a_sized_cold_start_compiles_each_graph_once(sized_start):
    """Sizing the cache from the activation peak compiles its sampler and prompt-logprob graphs as the real ones
    (only the stand-in-cache model is a peek), first the peak's graphs, then every graph the cache's size does not
    change, before the cache is sized; then the rest. Each graph compiles once, serving compiles none, the peak is
    what it was, and the timings count every compile."""
    llm, seen = sized_start()
    graphs = llm.engine.graphs
    assert seen["submitted"][:3] == PEAK_KEYS and PEAK not in graphs.manager.executables
    before = set(seen["submitted_before_sizing"])
    assert before == {PEAK, *graphs.cache_free_keys()} and not before & set(graphs.cache_bound_keys())
    assert len(seen["compiled"]) == len(set(seen["compiled"])) == len(graphs.manager.executables) + 1
    assert set(seen["compiled"]) == {PEAK, *graphs.graph_keys()}
    assert seen["peak"] == compiled_peak(graphs) > 0
    stats = llm.engine.stats()
    timings = stats["compile_timings"]
    assert {k: v["compiled"] for k, v in timings["kinds"].items()} == \
        {kind: sum(key.kind == kind for key in seen["compiled"]) for kind in {key.kind for key in seen["compiled"]}}
    assert timings["kinds"]["peak"]["compiled"] == 1 and timings["compile_wall_s"] > 0
    assert all(timings[k] > 0 for k in ("peak_s", "precompile_s", "trace_s", "compile_s"))
    buffers = llm.engine.runner.buffers   # every graph's, allocated at start: none made while serving
    made = set(buffers.outputs), {k: len(r) for k, r in buffers.sampled.items()}
    assert made[0] and made[0] == {(i, x.shape) for k in graphs.graph_keys() if k.kind == "model"
                                   for i, x in enumerate(graphs.output_structs(k.dims[0], k.dims[1], k.dims[3]))}
    assert made[1] == {k.dims: buffers.SAMPLED_RING for k in graphs.graph_keys() if k.kind == "sampler"}
    outs = llm.generate(*mixed_requests(), use_tqdm=False)
    assert all(o.finished for o in outs) and llm.engine.stats()["compiles_after_start"] == 0
    assert len(seen["compiled"]) == len(set(seen["compiled"])) == stats["compiled_graphs"] + 1
    assert made == (set(buffers.outputs), {k: len(r) for k, r in buffers.sampled.items()})


def test_a_sized_lazy_start_compiles_only_the_peak(sized_start):
    """Without precompile a start compiles what sizing the cache needs and nothing more (its sampler and
    prompt-logprob graphs are kept: serving uses them)."""
    llm, seen = sized_start(precompile=False)
    assert sorted(seen["compiled"]) == sorted(seen["submitted"]) == sorted(PEAK_KEYS)
    assert set(llm.engine.graphs.manager.executables) == set(seen["compiled"]) - {PEAK}


def test_lazy_graphs_are_counted():
    """Without precompile every graph compiles on first use, while serving: the counter says so."""
    llm = LLM(random_model(TINY, jnp.float32), **KNOBS, num_blocks=64, precompile=False)
    llm.generate([[2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["compiles_after_start"] == stats["compiled_graphs"] > 0


WARM_START = textwrap.dedent("""
    import json, sys
    import jax
    counts = {"/jax/compilation_cache/cache_hits": 0, "/jax/compilation_cache/cache_misses": 0}
    jax.monitoring.register_event_listener(lambda event, **_: event in counts and counts.__setitem__(event,
                                           counts[event] + 1))
    import jax.numpy as jnp
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import ModelConfig
    from jaxserve.models.loader import random_model
    cfg = json.loads(sys.argv[1])
    cfg = ModelConfig(**{**cfg, "eos_token_ids": tuple(cfg["eos_token_ids"])})
    llm = LLM(random_model(cfg, jnp.float32), **json.loads(sys.argv[2]))
    out = llm.generate([[5, 6, 7], [8] * 20], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)
    stats = llm.engine.stats()
    print(json.dumps({**{k.rsplit("/", 1)[1]: v for k, v in counts.items()},
                      **{k: stats[k] for k in ("compiled_graphs", "graphs_from_cache", "compiles_after_start")},
                      "tokens": [o.outputs[0].token_ids for o in out]}))
""")


@pytest.mark.slow
def test_a_warm_restart_compiles_nothing(tmp_path):
    """The runner's executables are kept on disk by default, under a fingerprint of what they depend on: a second
    start of the same engine loads every graph, traces and compiles none, and generates what the first did. On a
    CPU, XLA's own persistent cache stays off (compilation_cache says why): it is never consulted."""
    from dataclasses import asdict
    knobs = {**KNOBS, "token_buckets": [16, 64], "seq_buckets": [4, 8], "num_blocks": 64,
             "compile_cache_dir": str(tmp_path / "xla")}
    env = {k: v for k, v in os.environ.items() if k not in XLA_CACHE_ENV} | {"JAX_PLATFORMS": "cpu"}
    runs = [subprocess.run([sys.executable, "-c", WARM_START, json.dumps(asdict(TINY)), json.dumps(knobs)],
                           capture_output=True, text=True, timeout=300, env=env) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    cold, warm = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert cold["compiled_graphs"] > 0 and cold["graphs_from_cache"] == 0
    assert warm["graphs_from_cache"] == warm["compiled_graphs"] == cold["compiled_graphs"]
    assert warm["compiles_after_start"] == cold["compiles_after_start"] == 0
    assert warm["tokens"] == cold["tokens"] and all(len(t) == 6 for t in cold["tokens"])
    assert cold["cache_hits"] == cold["cache_misses"] == warm["cache_hits"] == warm["cache_misses"] == 0


def test_a_lazy_start_prefetches_what_the_last_lazy_start_wanted_first(tmp_path, without_xla_cache):
    """A start that compiles nothing ahead loads, while it goes on, the graphs the last such start of the same
    engine wanted first (kept on disk with them), and they serve its steps as compiled."""
    knobs = {**KNOBS, "num_blocks": 64, "precompile": False, "compile_cache_dir": str(tmp_path)}
    model, params = random_model(TINY, jnp.float32), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = LLM(model, **knobs)
    assert not first.engine.graphs.manager.pending   # nothing noted yet, nothing prefetched
    want = first.generate([[5, 6, 7], [8] * 20], params, use_tqdm=False)
    wanted = first.engine.graphs.manager.first_wanted
    assert {key.kind for key in wanted} >= {"model", "sampler"}
    again = LLM(model, **knobs)
    manager = again.engine.graphs.manager
    assert list(manager.pending) == wanted   # under way, or loaded and not yet asked for
    got = again.generate([[5, 6, 7], [8] * 20], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert manager.loaded_from_cache == len(wanted) and not manager.pending and manager.first_wanted == wanted


@pytest.mark.parametrize("capability, imported", [(9.0, True), (8.0, False), (0.0, False)])
def test_executable_cache_readies_mosaic_gpus_runtime_on_hopper(tmp_path, monkeypatch, capability, imported):
    """On Hopper the cache imports Mosaic GPU before it loads anything: an executable holding a Mosaic kernel finds
    the kernel runtime by the path that import sets (without it, every such executable compiles again)."""
    from jaxserve.engine import compilation
    kernels = sys.modules["pallas_kernels.ragged_paged_attention"]   # the package exports the function of its name
    names = []
    monkeypatch.setattr(kernels, "gpu_capability", lambda: capability)
    monkeypatch.setattr(compilation.importlib, "import_module", names.append)
    ExecutableCache(str(tmp_path), "fp")
    assert (names == ["jax.experimental.mosaic.gpu"]) == imported


def test_executable_cache_round_trip(tmp_path, without_xla_cache):
    """Executables saved by one manager load in another with the same fingerprint (and donate as compiled), not
    with another fingerprint; an unreadable file means compiling again."""
    f = jax.jit(lambda a, b: (a * 2, b + 1.0), donate_argnums=0)
    graphs = {("f", 4): lambda: f.lower(jnp.zeros(4), jnp.ones(4))}

    def manager(fp):
        m = CompilationManager(ExecutableCache(str(tmp_path), fp))
        m.compile_all(graphs)
        return m
    assert manager("a").loaded_from_cache == 0
    again = manager("a")
    assert again.loaded_from_cache == 1
    x = jnp.ones(4)
    out = again.executables[("f", 4)](x, jnp.ones(4))
    assert [o.tolist() for o in out] == [[2.0] * 4, [2.0] * 4] and x.is_deleted()
    assert manager("b").loaded_from_cache == 0
    for path in (tmp_path / "executables").iterdir():
        path.write_bytes(b"truncated")
    assert manager("a").loaded_from_cache == 0


def test_what_a_cache_served_is_not_kept_on_a_cpu(tmp_path):
    """XLA:CPU cannot serialize again an executable its persistent cache served (conftest turns that cache on): on a
    CPU the executable cache keeps what XLA compiled in the call, not what XLA's cache or jax's own memo (which may
    hold what XLA's cache served) handed back."""
    salt = float(time.time_ns() % 1_000_003)   # a graph no earlier run put in XLA's cache
    f = jax.jit(lambda a: a * salt)
    graphs = {("f", 4): lambda: f.lower(jnp.zeros(4))}
    for name, served, forget in (("compiled", False, True), ("xla", True, True), ("memo", True, False)):
        if forget:
            jax.clear_caches()   # the compile reaches XLA (its persistent cache), not this process's memo
        CompilationManager(ExecutableCache(str(tmp_path / name), "fp")).compile_all(graphs)
        kept = len(list((tmp_path / name / "executables").glob("*.bin")))
        assert kept == (0 if served and jax.default_backend() == "cpu" else 1), name


def test_the_cache_size_is_in_the_keys_of_the_graphs_that_take_the_cache():
    """The fingerprint is final before any graph compiles; a graph that takes the cache carries its size in its key
    (a start that sizes the cache differently reuses every other executable), one that does not, does not."""
    model = random_model(TINY, jnp.float32)
    graphs = [LLM(model, **{**KNOBS, "num_blocks": n, "precompile": False}).engine.graphs for n in (32, 64)]
    assert graphs[0].manager.cache.fingerprint == graphs[1].manager.cache.fingerprint
    keys = [set(g.graph_keys()) for g in graphs]
    assert {k for k in keys[0] if k.num_blocks is None} == {k for k in keys[1] if k.num_blocks is None}
    assert {(k.kind, k.num_blocks) for k in keys[0] - keys[1]} == {("model", 32), ("copy", 32)}


def test_forks_wider_than_their_prompt_compile_nothing():
    """A prompt's n > 1 children join its last chunk as rows without tokens: a 2-token prompt with n = 6 is 6 rows
    and 2 tokens, a (token, seq) bucket pair that is never compiled (the step pads its tokens to cover its rows)."""
    llm = LLM(random_model(TINY, jnp.float32), **{**KNOBS, "token_buckets": (4, 64)}, num_blocks=64)
    out = llm.generate([[2, 3]], SamplingParams(temperature=1.0, n=6, seed=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs) == 6 and llm.engine.stats()["compiles_after_start"] == 0


def test_host_only_knobs_keep_the_executables_and_graph_knobs_do_not(monkeypatch):
    """The executable cache's fingerprint: a knob only the host reads (admission bounds, watermark, cache dir)
    leaves it as it is, so a warm start with new bounds loads every executable; a bucket ladder changes it, and so
    does a switch of the linear layers' paths (a benchmark timing XLA's GEMMs beside the kernels)."""
    from jaxserve.models import fp8, llama
    model = random_model(TINY, jnp.float32)

    def fingerprint(**knobs) -> str:
        llm = LLM(model, **{**KNOBS, "num_blocks": 64, "precompile": False, **knobs})
        return llm.engine.graphs.manager.cache.fingerprint
    base = fingerprint()
    assert fingerprint(max_queued_requests=5, watermark=0.2, compile_cache_dir="/tmp/elsewhere") == base
    assert fingerprint(seq_buckets=(8,)) != base and fingerprint(block_size=8) != base
    monkeypatch.setattr(llama, "BF16_DECODE_KERNEL", not llama.BF16_DECODE_KERNEL)
    assert fingerprint() != base
    monkeypatch.undo()
    monkeypatch.setattr(fp8, "W8A8_KERNELS", False)
    assert fingerprint() != base


def test_a_step_traces_its_layers_once(monkeypatch):
    """The layers share a structure: a step graph traces one decoder layer, not one per layer (start-up's tracing,
    on its critical path, scales with the shapes, not the layer count), and runs the same math (greedy tokens
    equal a per-layer trace's)."""
    import dataclasses

    from jaxserve.models import llama
    model = random_model(dataclasses.replace(TINY, num_layers=4, hidden_size=80), jnp.float32)  # shapes of its own
    traced, call = [], llama.DecoderLayer.__call__
    monkeypatch.setattr(llama.DecoderLayer, "__call__", lambda *a: traced.append(1) or call(*a))
    llm = LLM(model, **{**KNOBS, "precompile": False, "num_blocks": 64})
    llm.engine.graphs.lower(llm.engine.graphs.model_key(16, 4, False))
    assert len(traced) == 1
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [9] * 20], params, use_tqdm=False)]
    monkeypatch.setattr(llama, "run_layer", llama.run_layer.__wrapped__)   # the layers traced one by one
    unrolled = LLM(model, **{**KNOBS, "precompile": False, "num_blocks": 64})
    assert got == [o.outputs[0].token_ids for o in unrolled.generate([[5, 6, 7], [9] * 20], params, use_tqdm=False)]


def test_each_graph_compiles_with_its_keys_xla_options():
    """The manager hands XLA the options its caller gives for each key; the runner's policy: on GPU, graphs of the
    model's weights (model, prompt logprobs, the peak stand-in) merge no dots and take cuBLAS GEMMs when FP8 or of
    more rows than TRITON_GEMM_MAX_ROWS (FP8 weights: W8A16_MAX_ROWS); nothing on CPU."""
    seen = {}

    class Spy:
        def __init__(self, key, lowered):
            self.key, self.lowered = key, lowered

        def compile(self, options=None):
            seen[self.key] = options
            return self.lowered.compile(options)
    f = jax.jit(lambda a: a * 3.0)
    keys = [("model", 16, 16, True), ("model", 4096, 256, False)]
    m = CompilationManager(options=lambda key: {"xla_cpu_enable_fast_math": False} if key[1] > 64 else {})
    m.compile_all({k: functools.partial(Spy, k, f.lower(jnp.zeros(k[1]))) for k in keys})
    assert seen == {keys[0]: None, keys[1]: {"xla_cpu_enable_fast_math": False}}
    assert m.executables[keys[1]](jnp.ones(4096)).tolist() == [3.0] * 4096

    def policy(platform, quantization=None):
        device = types.SimpleNamespace(platform=platform)
        graphs = types.SimpleNamespace(token_buckets=(16, 64, 4096), quantization=quantization,
                                       mesh=types.SimpleNamespace(devices=np.array([device])))
        return lambda key: StepGraphs.compiler_options(graphs, key)
    gpu, cpu, fp8 = policy("gpu"), policy("cpu"), policy("gpu", "fp8")
    unmerged = {"xla_gpu_dot_merger_threshold_mb": 0}
    cublas = unmerged | {"xla_gpu_enable_triton_gemm": False}
    small, large = GraphKey("model", (TRITON_GEMM_MAX_ROWS, 64, True, 1), 99), GraphKey("model", (128, 64, False, 1), 99)
    assert gpu(large) == gpu(GraphKey("prompt", (4096,))) == gpu(PEAK) == cublas
    assert gpu(small) == unmerged and gpu(GraphKey("sampler", (256, "filter", 0, False, 1))) == {}
    decode = GraphKey("model", (W8A16_MAX_ROWS, W8A16_MAX_ROWS, True, 1), 99)
    assert fp8(small) == fp8(large) == fp8(PEAK) == cublas and fp8(decode) == unmerged
    assert cpu(GraphKey("model", (4096, 256, False, 1), 99)) == cpu(PEAK) == {}


def test_a_warm_start_reads_the_activation_peak_it_measured(sized_start, tmp_path):
    """The peak a start measured is kept beside the compile cache: the next start of the same graphs sizes the
    cache from it without compiling (or loading) the peak's graphs."""
    _, seen = sized_start(precompile=False, compile_cache_dir=str(tmp_path))
    peak = seen["peak"]
    warm, _ = sized_start(precompile=False, compile_cache_dir=str(tmp_path))
    assert seen["peak"] == peak > 0 and sorted(seen["compiled"]) == sorted(PEAK_KEYS)
    assert "peak" not in warm.engine.stats()["compile_timings"]["kinds"]
