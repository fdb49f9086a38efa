"""No request can break the engine: bad values are refused at admission naming the field, requests that can never
fit are refused at once, queues are bounded, and the engine keeps serving the others (issue: fault isolation)."""
import dataclasses

import jax.numpy as jnp
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig, load_run_config
from jaxserve.engine.llm_engine import AdmissionError
from jaxserve.engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from jaxserve.models.loader import random_model

from helpers import TINY_NO_EOS

TINY = dataclasses.replace(TINY_NO_EOS, max_position_embeddings=1024)
KNOBS = dict(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64, min_prefill_chunk=16, num_blocks=24,
             precompile=False, watermark=0.0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(random_model(TINY, jnp.float32), **KNOBS)


def serve_one(engine, prompt=(1, 2, 3)):
    """A good request runs to the end beside whatever was refused."""
    rid = engine.add_request(list(prompt), GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(done[rid].outputs[0].token_ids) == GREEDY.max_tokens
    engine.step()
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["waiting"] == stats["running"] == 0


@pytest.mark.parametrize("params, field", [
    (dict(top_k=2**40), "top_k"),                                  # overflowed int32 on the engine thread
    (dict(stop_token_ids=[2**31], min_tokens=2), "stop_token_ids"),
    (dict(stop_token_ids=[128], min_tokens=2), "stop_token_ids"),  # outside the vocabulary
    (dict(max_tokens=2**31), "max_tokens"), (dict(min_tokens=2**31, max_tokens=None), "min_tokens"),
    (dict(top_p=1e-50), "top_p"),                                  # 0 in float32: top-p silently off
    (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"), (dict(stop=["x" * (MAX_STOP_CHARS + 1)]), "stop"),
    (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
])
def test_out_of_range_values_are_refused_and_the_engine_keeps_serving(llm, params, field):
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request([1, 2, 3], SamplingParams(**params))
    serve_one(llm.engine)


def test_a_huge_cache_salt_is_refused(llm):
    with pytest.raises(ValueError, match="cache_salt"):
        llm.engine.add_request([1, 2, 3], GREEDY, cache_salt="s" * 1_000_000)


def test_stop_ids_never_change_the_compiled_shape(llm):
    """The suppressed-ids tensor has one width whatever a request asks: no graph compiles for a long list."""
    from jaxserve.engine.sampler import make_sampling_tensors
    widths = {make_sampling_tensors([SamplingParams(min_tokens=4, stop_token_ids=list(range(n)))], [0], [0],
                                    num_rows=1, eos_token_ids=[0, 1, 2]).suppress_ids.shape for n in (0, 5, 16)}
    assert len(widths) == 1


def test_error_messages_stay_short_whatever_was_sent():
    with pytest.raises(ValueError) as err:
        SamplingParams(stop=["ok", 7] * 50_000)
    assert len(str(err.value)) < 300


def test_a_request_that_can_never_fit_the_pool_is_refused_at_once(llm):
    """24 blocks of 16 tokens: a 400-token prompt with 64 more to generate used to wait forever at the head of
    the queue, blocking everything behind it."""
    with pytest.raises(AdmissionError, match="max_tokens"):
        llm.engine.add_request(list(range(1, 100)) * 4, SamplingParams(max_tokens=64))
    with pytest.raises(AdmissionError, match="max_tokens"):   # None: up to max_model_len, more than the pool
        llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=None))
    llm.engine.add_request(list(range(1, 100)) * 3, SamplingParams(max_tokens=60, ignore_eos=True))  # just fits
    serve_one(llm.engine)


def test_queues_are_bounded_by_requests_and_tokens():
    engine = LLM(random_model(TINY, jnp.float32), **KNOBS, max_queued_requests=2, max_queued_tokens=50).engine
    engine.add_request([1] * 10, GREEDY)
    engine.add_request([2] * 10, GREEDY)
    with pytest.raises(AdmissionError, match="max_queued_requests=2"):
        engine.add_request([3] * 10, GREEDY)
    engine.step()                                     # both admitted: the queue is empty again
    engine.add_request([4] * 40, GREEDY)
    with pytest.raises(AdmissionError, match="max_queued_tokens=50"):
        engine.add_request([5] * 11, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("knobs, field", [
    (dict(seq_buckets=[8], max_num_seqs=32), "seq_buckets"),            # used to die mid-run (StopIteration)
    (dict(token_buckets=[16, 64], max_num_batched_tokens=256), "token_buckets"),
    (dict(token_buckets=[64, 16, 256]), "token_buckets"), (dict(seq_buckets=[0, 32]), "seq_buckets"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(block_size=-16), "block_size"),
    (dict(max_num_seqs="32"), "max_num_seqs"), (dict(memory_fraction=1.5), "memory_fraction"),
    (dict(num_blocks=1), "num_blocks"), (dict(async_scheduling="yes"), "async_scheduling"),
    (dict(max_num_batched_tokens=40), "max_num_batched_tokens"), (dict(max_queued_tokens=0), "max_queued_tokens"),
    (dict(decode_attention="flash"), "decode_attention"),
])
def test_engine_config_is_checked_whole_at_construction(knobs, field):
    with pytest.raises(ValueError, match=f"engine config: {field}"):
        EngineConfig(**knobs)


@pytest.mark.parametrize("text, match", [
    ("engine: {max_num_seqs: 8, bogus: 1}", r"unknown engine keys \['bogus'\]"),
    ("modle: x", r"unknown keys \['modle'\]"),
    ("engine: {max_num_seqs: [", "not valid YAML"),
    ("- a list", "must be a mapping"),
    ("engine: {max_num_seqs: -1}", "max_num_seqs must be a positive int"),
    ("engine: {seq_buckets: [8], max_num_seqs: 32}", "seq_buckets"),
])
def test_config_files_fail_with_the_file_and_key_named(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        load_run_config(path)
    assert str(path) in str(err.value)
    with pytest.raises(ValueError, match="cannot read"):
        load_run_config(tmp_path / "missing.yaml")
