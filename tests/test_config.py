"""EngineConfig's declared knobs: every field carries a KnobSpec, and what is derived from them (graph_knobs, the
CLI's engine flags, the per-knob checks) matches what the engine relies on. No engine is built."""
import dataclasses
from pathlib import Path

import pytest

from jaxserve import cli
from jaxserve.config import (GROUPS, KNOBS, EngineConfig, KnobSpec, SpeculativeConfig, engine_flags, graph_knobs,
                             load_run_config)

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
# Not in the executable cache's fingerprint: no compiled graph reads these, or (num_blocks) the graphs that do carry
# it in their keys. A change to one must leave the fingerprint as it is.
HOST_ONLY = {"compile_cache_dir", "precompile", "max_queued_requests", "max_queued_tokens", "watermark",
             "memory_fraction", "min_prefill_chunk", "vattention_lookahead_tokens", "num_blocks", "generation_config"}
# A value other than the default that passes every check, per knob (with DEFAULT_OK's other knobs).
OTHER_VALUE = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512, min_prefill_chunk=64,
                   async_scheduling=False, seed=7, block_size=32, num_blocks=64, memory_fraction=0.5,
                   enable_prefix_caching=False, watermark=0.1, kv_backend="vattention", kv_cache_dtype="fp8",
                   token_buckets=(16, 256),
                   seq_buckets=(8, 32), decode_attention="cuda", prefill_attention="mosaic", cascade_attention="off",
                   compile_cache_dir="/tmp/elsewhere", precompile=False, tensor_parallel_size=2,
                   max_queued_requests=5, max_queued_tokens=1000, generation_config="vllm",
                   vattention_lookahead_tokens=64,
                   vattention_kernels="identity", speculative_config=SpeculativeConfig())
# What OTHER_VALUE's kv_backend needs from the other knobs to pass the checks between knobs.
NEEDS = dict(kv_backend=dict(enable_prefix_caching=False))


def test_every_field_declares_a_group_and_a_check():
    fields = dataclasses.fields(EngineConfig)
    assert [f.name for f in fields] == list(KNOBS)
    for f in fields:
        spec = f.metadata.get("knob")
        assert isinstance(spec, KnobSpec), f.name
        assert spec.group in GROUPS and spec.check is not None, f.name
    groups = [KNOBS[f.name].group for f in fields]
    assert groups == sorted(groups, key=GROUPS.index), "the class body is ordered by group"


def test_the_defaults_pass_their_checks():
    cfg = EngineConfig()
    for name, spec in KNOBS.items():
        assert spec.check.ok(getattr(cfg, name)), name


def test_graph_knobs_exclude_exactly_the_host_only_knobs():
    assert {name for name, spec in KNOBS.items() if not spec.graphs} == HOST_ONLY
    assert set(graph_knobs(EngineConfig())) == set(KNOBS) - HOST_ONLY


@pytest.mark.parametrize("name", sorted(OTHER_VALUE))
def test_a_knob_changes_graph_knobs_iff_graphs_depend_on_it(name):
    assert set(OTHER_VALUE) == set(KNOBS)
    base = EngineConfig(**NEEDS.get(name, {}))
    changed = dataclasses.replace(base, **{name: OTHER_VALUE[name]})
    assert getattr(changed, name) != getattr(base, name)
    assert (graph_knobs(changed) == graph_knobs(base)) == (name in HOST_ONLY)


def test_every_cli_flag_is_an_int_knob():
    flags = engine_flags()
    assert cli.ENGINE_FLAGS == flags
    assert set(flags) == {"max_num_seqs", "max_num_batched_tokens", "min_prefill_chunk",
                          "num_blocks", "max_queued_requests", "max_queued_tokens"}   # --max-model-len: every command
    for name in flags:   # cli.py registers each as `--kebab-name`, type=int
        assert name in KNOBS
        default = getattr(EngineConfig(), name)
        assert default is None or type(default) is int, name
    parser = cli.build_parser()
    args = parser.parse_args(["serve", *(f"--{n.replace('_', '-')}={v}" for n, v in
                                         [("max_num_seqs", 8), ("max_queued_tokens", 100)])])
    cfg = cli.served_engine_config(args)
    assert (cfg.max_num_seqs, cfg.max_queued_tokens) == (8, 100)


@pytest.mark.parametrize("name, bad, rule", [
    ("max_model_len", 0, "must be a positive int or null"),
    ("max_queued_requests", 0, "must be a positive int or null"),
    ("precompile", "yes", "must be true or false"), ("seed", 1.5, "must be an int"),
    ("num_blocks", 1, r"must be an int >= 2 \(block 0 is the null block\) or null"),
    ("memory_fraction", 0, r"must be in \(0, 1\]"), ("watermark", 1, r"must be in \[0, 1\)"),
    ("prefill_attention", "flash", r"must be one of \('auto', 'triton', 'mosaic'\)"),
    ("vattention_lookahead_tokens", -1, "must be an int >= 0"), ("compile_cache_dir", 3, "must be a path or null"),
    ("seq_buckets", (8, 8), "must be null or a strictly increasing list of positive ints"),
    ("kv_cache_dtype", "int8", r"must be one of \('auto', 'fp8'\)"),
])
def test_a_bad_knob_is_named_with_its_rule(name, bad, rule):
    with pytest.raises(ValueError, match=rf"^engine config: {name} {rule}, got "):
        EngineConfig(**{name: bad})


def test_the_cli_passes_quantization_and_the_kv_cache_dtype():
    args = cli.build_parser().parse_args(["serve", "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    assert args.quantization == "fp8" and cli.served_engine_config(args).kv_cache_dtype == "fp8"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_shipped_config_loads(path):
    run = load_run_config(path)
    assert isinstance(run.engine, EngineConfig)


@pytest.mark.parametrize("value", ["on", "off"])
def test_a_bare_on_or_off_in_yaml_is_the_knobs_word(tmp_path, value):
    """PyYAML reads a bare on / off as a boolean; cascade_attention takes the word it meant."""
    config = tmp_path / "run.yaml"
    config.write_text(f"engine:\n  cascade_attention: {value}\n")
    assert load_run_config(config).engine.cascade_attention == value


def test_serve_takes_max_model_len_over_the_config(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("engine:\n  max_model_len: 200\n")
    parse = cli.build_parser().parse_args
    assert cli.served_engine_config(parse(["serve", "--config", str(config), "--max-model-len", "300"])
                                    ).max_model_len == 300
    assert cli.served_engine_config(parse(["serve", "--config", str(config)])).max_model_len == 200
    assert cli.served_engine_config(parse(["serve"])).max_model_len is None   # the model's, decided at start
