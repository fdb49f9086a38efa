"""The step graphs' keys: the graphs compiled before serving are the key function over every size a step can have,
so no step the scheduler forms meets a graph that was not compiled (pure functions: no model, no compile); and the
byte buffer a step's inputs travel in."""
import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxserve.config import EngineConfig
from jaxserve.engine.step_graphs import bucket_ladders, step_shape, step_sizes
from jaxserve.engine.step_inputs import PACK_ALIGN, layout_of, pack, unpack


def compiled_shapes(cfg: EngineConfig, has_decode_kernel: bool, cpu: bool = False) -> set:
    ladders = bucket_ladders(cfg, cpu)
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
@given(configs(), st.data(), st.booleans(), st.booleans())
def test_every_step_the_scheduler_can_form_has_a_compiled_graph(cfg, data, has_decode_kernel, cpu):
    """A step has 1..max_num_seqs rows and 0..max_num_batched_tokens tokens (n > 1 children are rows without
    tokens); it is decode-only when every row has one token."""
    compiled = compiled_shapes(cfg, has_decode_kernel, cpu)
    ladders = bucket_ladders(cfg, cpu)
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


@pytest.mark.parametrize("cpu", [True, False])
def test_one_streams_decode_multiplies_one_row_on_a_cpu(cpu):
    """A CPU multiplies every padded row by the weights: there one stream decodes in a graph of one token and one
    row. Elsewhere the default seq ladder keeps its smallest bucket; decode steps still pad their tokens only to
    their seq bucket, never to a larger token bucket."""
    cfg = EngineConfig()
    ladders = bucket_ladders(cfg, cpu)
    assert (ladders[1][0] == 1) == cpu
    assert step_shape(1, 1, True, ladders, has_decode_kernel=not cpu) == ((1, 1, False) if cpu else (8, 8, True))
    assert step_shape(5, 1, False, ladders, has_decode_kernel=not cpu)[:2] == (16, ladders[1][0])
    assert bucket_ladders(dataclasses.replace(cfg, seq_buckets=(4, 32)), cpu)[1] == (4, 32)   # a config's own ladder


@settings(max_examples=200, deadline=None)
@given(configs(), st.data(), st.integers(2, 9), st.booleans())
def test_every_speculative_step_has_a_compiled_graph(cfg, data, width, cpu):
    """A speculative step (rows sampling at `width` positions) pads its tokens to seq bucket x width where that is
    smaller: those shapes are compiled too, for any mix of drafted decodes and prefill chunks."""
    ladders = bucket_ladders(cfg, cpu)
    compiled = {step_shape(*size, ladders, True, width) for size in step_sizes(cfg, ladders, width)}
    for _ in range(20):
        rows = data.draw(st.integers(1, cfg.max_num_seqs))
        tokens = data.draw(st.integers(rows, cfg.max_num_batched_tokens))
        assert step_shape(tokens, rows, False, ladders, True, width) in compiled


def test_a_speculative_decode_pads_to_its_rows_times_width():
    ladders = bucket_ladders(EngineConfig(max_num_seqs=8, max_num_batched_tokens=256), cpu=True)
    assert step_shape(5, 1, False, ladders, False, 5) == (5, 1, False)      # one row, 4 drafts: 5 tokens, not 16
    assert step_shape(3, 1, False, ladders, False, 5) == (5, 1, False)
    assert step_shape(30, 8, False, ladders, False, 5) == (32, 8, False)    # the token bucket is smaller
    assert step_shape(100, 8, False, ladders, False, 5) == (128, 8, False)  # with a prefill chunk


def test_unpack_in_a_graph_gives_back_the_bits_pack_joined():
    """Odd sizes (no leaf starts aligned), every dtype a step sends, float bit patterns (NaN, -0, subnormals)."""
    rng = np.random.default_rng(0)
    leaves = [rng.integers(-2**31, 2**31, (5,), dtype=np.int32), rng.random(3) < 0.5,
              rng.integers(0, 2**32, (3, 2), dtype=np.uint64).astype(np.uint32),
              np.array([np.nan, -0.0, 1e-45, np.inf, -1.5], np.float32),
              rng.integers(-2**31, 2**31, (2, 7), dtype=np.int32), np.zeros((0,), np.int32), np.array([True])]
    packed = pack(leaves)
    at = 0   # each leaf from a multiple of PACK_ALIGN (a GPU kernel may refuse an unaligned view of the buffer)
    for leaf in leaves:
        assert at % PACK_ALIGN == 0 and np.array_equal(packed[at:at + leaf.nbytes], leaf.view(np.uint8).reshape(-1))
        at += -(-leaf.nbytes // PACK_ALIGN) * PACK_ALIGN
    assert at == packed.size
    out = jax.jit(unpack, static_argnums=1)(packed, layout_of(leaves))
    assert layout_of(out) == layout_of(leaves)
    for got, want in zip(out, leaves):
        assert np.array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
