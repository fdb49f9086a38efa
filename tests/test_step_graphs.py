"""The step graphs' keys: the graphs compiled before serving are the key function over every size a step can have,
so no step the scheduler forms meets a graph that was not compiled (pure functions: no model, no compile)."""
from hypothesis import given, settings, strategies as st

from jaxserve.config import EngineConfig
from jaxserve.engine.step_graphs import bucket_ladders, step_shape, step_sizes


def compiled_shapes(cfg: EngineConfig, has_decode_kernel: bool) -> set:
    ladders = bucket_ladders(cfg)
    return {step_shape(*size, ladders, has_decode_kernel) for size in step_sizes(cfg, ladders)}


@st.composite
def configs(draw) -> EngineConfig:
    """A valid engine config with random bucket ladders (or the default ones)."""
    max_seqs = draw(st.integers(1, 300))
    max_tokens = max_seqs + draw(st.integers(1, 5000))

    def ladder(high):
        inner = draw(st.lists(st.integers(1, high - 1), max_size=6, unique=True)) if high > 1 else []
        return None if draw(st.booleans()) else tuple(sorted(inner)) + (high + draw(st.integers(0, 3)),)
    return EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, min_prefill_chunk=1,
                        max_model_len=max_tokens, token_buckets=ladder(max_tokens), seq_buckets=ladder(max_seqs))


@settings(max_examples=300, deadline=None)
@given(configs(), st.data(), st.booleans())
def test_every_step_the_scheduler_can_form_has_a_compiled_graph(cfg, data, has_decode_kernel):
    """A step has 1..max_num_seqs rows and 0..max_num_batched_tokens tokens (n > 1 children are rows without
    tokens); it is decode-only when every row has one token."""
    compiled = compiled_shapes(cfg, has_decode_kernel)
    ladders = bucket_ladders(cfg)
    for _ in range(20):
        rows = data.draw(st.integers(1, cfg.max_num_seqs))
        decode = data.draw(st.booleans())
        tokens = rows if decode else data.draw(st.integers(0, cfg.max_num_batched_tokens))
        assert step_shape(tokens, rows, decode, ladders, has_decode_kernel) in compiled


def test_decode_steps_of_a_seq_bucket_spanning_token_buckets_are_compiled():
    """Seq bucket 64 holds 9..64 rows: their decode steps pad to token bucket 16 or 64, and both compile (pairing
    each seq bucket with the one token bucket that holds it missed (16, 64): a 5 s stall of every stream on an H100
    the first time 9..16 sequences decoded together)."""
    cfg = EngineConfig(max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=4096,
                       token_buckets=(16, 64, 256, 1024, 2048, 4096), seq_buckets=(8, 64, 256))
    compiled = compiled_shapes(cfg, has_decode_kernel=True)
    assert {(16, 64, True), (64, 64, True), (256, 256, True), (16, 64, False)} <= compiled
    ladders = bucket_ladders(cfg)
    assert all(step_shape(n, n, True, ladders, True) in compiled for n in range(1, 257))
