import pytest

from jaxserve.engine.sampler import mode_for
from jaxserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, 0, 0.0, 16, 0)
    assert (p.stop, p.stop_token_ids, p.seed, p.logprobs) == ([], [], None, None)
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output


def test_stop_str_becomes_list_and_ints_become_floats():
    p = SamplingParams(stop="###", stop_token_ids=(3, 4), temperature=1, top_p=1)
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4]
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_greedy_below_threshold(temperature, greedy):
    """The engine samples a request greedily (argmax, no random draw) below GREEDY_TEMPERATURE."""
    assert mode_for([SamplingParams(temperature=temperature)], vocab_size=32) == ("greedy" if greedy else "sample")


def test_edges_accepted():
    SamplingParams(top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
                   max_tokens=None, min_tokens=5, logprobs=MAX_LOGPROBS, prompt_logprobs=0, seed=-(2**63))
    SamplingParams(max_tokens=3, min_tokens=3, top_k=1, seed=2**63 - 1, repetition_penalty=1e-3)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2), ("min_p", -0.01), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -2.01),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1),
    ("prompt_logprobs", MAX_LOGPROBS + 1), ("seed", 2**63), ("stop", ""), ("stop", ["ok", ""]), ("stop", [1]),
    ("stop", 5), ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", 3),
    ("stop_token_ids", [True]), ("seed", 1.5), ("seed", "7"), ("temperature", "hot"), ("n", 2.0), ("n", True),
    ("top_k", 1.5), ("ignore_eos", 1), ("skip_special_tokens", "yes"), ("include_stop_str_in_output", None),
    ("max_tokens", 4.0), ("top_p", "high"), ("min_p", True), ("repetition_penalty", "1"), ("output_kind", 2),
])
def test_bad_value_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=10_000).min_tokens == 10_000


def test_unset_fields_read_as_vllms_and_take_a_models_defaults():
    unset = SamplingParams(top_k=5, max_tokens=None)
    assert unset.unset == {"temperature", "top_p", "min_p", "repetition_penalty"}
    assert (unset.temperature, unset.top_p, unset.min_p, unset.repetition_penalty) == (1.0, 1.0, 0.0, 1.0)
    model = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "max_tokens": 100}
    got = unset.with_defaults(model, room=60)
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty) == (0.2, 0.9, 5, 0.0, 1.1)
    assert got.max_tokens == 60   # the model's bound, within what the prompt leaves
    assert unset.with_defaults(model, room=500).max_tokens == 100
    assert unset.with_defaults({}, room=60) is unset
    explicit = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_tokens=7)
    assert explicit.unset == frozenset() and explicit.with_defaults(model, room=60) is explicit
