"""Structured outputs in the engine: the constraint's validation and compile errors, the sampler's token bitmask
against a numpy reference, and constrained generation (a random model with a small byte-level tokenizer: without
the mask its output is noise, so every match below is the mask's doing; then the embedded model), under both
schedulings, n > 1, preemption, beside unconstrained requests. The HTTP and gRPC surfaces are in
test_structured_outputs_api.py."""
import dataclasses
import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from jaxserve.engine.llm import LLM
from jaxserve.engine.sampler import allowed_tokens, init_penalty_state, make_sampling_tensors, sample
from jaxserve.engine.sampling_params import MAX_STRUCTURED_CHARS, SamplingParams, StructuredOutputsParams
from jaxserve.models.loader import random_model
from helpers import KNOBS, SERVER_KNOBS, TINY

SO = StructuredOutputsParams
# a random model writes whatever the mask allows: bounded strings and numbers keep its outputs finite
RECORD = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["cat", "dog", "bird"]},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 2},
    "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 5}]}},
    "required": ["id", "kind", "ok"]}
CONSTRAINTS = [
    (SO(json=RECORD), lambda text: jsonschema.validate(json.loads(text), RECORD) is None),
    (SO(regex=r"[a-c]{3}-[0-9]{2}"), lambda text: re.fullmatch(r"[a-c]{3}-[0-9]{2}", text) is not None),
    (SO(choice=["alpha", "beta", "gamma delta"]), lambda text: text in ("alpha", "beta", "gamma delta")),
    (SO(grammar='start: "(" NUM ("+" NUM)? ")"\nNUM: /[1-9][0-9]?/'),   # finite: a random model repeats
     lambda text: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)?\)", text) is not None),
    (SO(grammar='root ::= "x" [0-9] [0-9]? "y"'), lambda text: re.fullmatch(r"x[0-9][0-9]?y", text) is not None),
]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A 300-token byte-level BPE (the kind llguidance reads from HF tokenizers) with an EOS at id 1."""
    bpe = ByteLevelBPETokenizer()
    text = ['{"id": 12, "kind": "cat", "ok": true, "tags": ["ab"]}', "alpha beta gamma delta", "abc-12 (1+2)"] * 50
    bpe.train_from_iterator(text, vocab_size=300, special_tokens=["<pad>", "<eos>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tokenized():
    tokenizer = byte_level_tokenizer()
    cfg = dataclasses.replace(TINY, vocab_size=320, eos_token_ids=(1,))   # 20 ids past the tokenizer: never allowed
    return dataclasses.replace(random_model(cfg, jnp.float32), tokenizer=tokenizer)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, tokenized):
    return LLM(tokenized, **{**KNOBS, "num_blocks": 512, "async_scheduling": request.param})


def constrained(spec, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 48, **kw}, structured_outputs=spec)


@pytest.mark.parametrize("kwargs, error", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["b"]), "exactly one"),
    (dict(json="{not json"), "structured_outputs.json: not valid JSON"),
    (dict(json=[1, 2]), "structured_outputs.json must be a JSON schema"),
    (dict(json=False), "structured_outputs.json must be a JSON schema"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", 3]), "structured_outputs.choice"),
    (dict(regex=""), "structured_outputs.regex must be a non-empty string"),
    (dict(grammar="x" * (MAX_STRUCTURED_CHARS + 1)), "structured_outputs.grammar: 65,537 characters"),
    (dict(json_object="yes"), "json_object must be a bool"),
])
def test_a_malformed_constraint_is_refused_naming_its_field(kwargs, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        SO(**kwargs)


@pytest.mark.parametrize("spec, error", [
    (SO(regex="a[b"), "structured_outputs.regex"),
    (SO(json={"type": "object", "properties": 5}), "structured_outputs.json"),
    (SO(json={"type": "strnig"}), "structured_outputs.json"),
    (SO(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_an_invalid_constraint_is_refused_and_the_engine_keeps_serving(llm, spec, error):
    engine = llm.engine
    with pytest.raises(ValueError, match=re.escape(error)):
        engine.add_request([5, 6, 7], constrained(spec))
    assert not engine.requests and not engine.has_unfinished_requests()
    check, spec = CONSTRAINTS[1][1], CONSTRAINTS[1][0]
    assert check(llm.generate([[5, 6, 7]], constrained(spec), use_tqdm=False)[0].outputs[0].text)


def test_allowed_tokens_unpacks_the_bitmask_like_numpy():
    rng = np.random.default_rng(0)
    vocab = 100   # not a multiple of 32: the last word's high bits are past the vocabulary
    bitmask = rng.integers(-2**31, 2**31, size=(5, 4), dtype=np.int64).astype(np.int32)
    expected = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    np.testing.assert_array_equal(np.asarray(allowed_tokens(jnp.asarray(bitmask), vocab)), expected)


@pytest.mark.parametrize("mode", ["greedy", "sample", "filter"])
def test_the_sampler_draws_only_allowed_tokens(mode):
    """Random logits and masks: each row's token is allowed (a row whose best logits are masked shows the mask
    works), and an all-ones row samples as with no mask at all."""
    rng, rows, vocab = np.random.default_rng(1), 8, 96
    logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 4, jnp.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(rows, vocab // 32), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1
    params = [SamplingParams(temperature=0.0 if mode == "greedy" else 0.9, top_k=20 if mode == "filter" else 0,
                             seed=i) for i in range(rows)]
    t = make_sampling_tensors(params, list(range(rows)), [0] * rows, num_rows=rows, eos_token_ids=())
    state, slots, on = init_penalty_state(rows, vocab), jnp.arange(rows), jnp.ones(rows, bool)
    masked, _ = sample(logits, t, state, slots, on, mode=mode, token_bitmask=jnp.asarray(bitmask))
    free, _ = sample(logits, t, state, slots, on, mode=mode)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    tokens = np.asarray(masked.tokens)
    assert allowed[np.arange(rows), tokens].all()
    assert tokens[0] == np.asarray(free.tokens)[0]
    assert (tokens != np.asarray(free.tokens)).any()


def test_every_constraint_holds_on_a_random_model(llm):
    """Greedy and sampled, all constraints in one batch (their masks filled together), each output checked."""
    specs = [spec for spec, _ in CONSTRAINTS] * 2
    params = [constrained(spec, temperature=0.0 if i < len(CONSTRAINTS) else 1.0, seed=i)
              for i, spec in enumerate(specs)]
    outs = llm.generate([[5 + i, 6, 7] for i in range(len(specs))], params, use_tqdm=False)
    for (spec, check), out in zip(CONSTRAINTS * 2, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), (spec.key, c.text, c.finish_reason)


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[9, 8, 7, 6], [3, 4]]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    mixed = llm.generate(prompts + [[5, 6]], [plain, plain, constrained(CONSTRAINTS[0][0])], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert CONSTRAINTS[0][1](mixed[2].outputs[0].text)


def test_n_samples_each_follow_the_grammar(llm):
    spec, check = CONSTRAINTS[1]
    out = llm.generate([[5, 6, 7]], constrained(spec, n=3, temperature=1.0, seed=7), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(check(c.text) for c in out.outputs)
    assert len({c.text for c in out.outputs}) > 1


def test_the_grammar_survives_preemption(tokenized):
    """A KV pool too small for the batch preempts (recomputes) sequences mid-output: their matchers keep their
    place, so every output still matches."""
    llm = LLM(tokenized, **{**KNOBS, "num_blocks": 12, "block_size": 16})
    spec, check = CONSTRAINTS[0]
    outs = llm.generate([[5 + i] * 20 for i in range(6)], constrained(spec, temperature=1.0, seed=3,
                                                                       max_tokens=60), use_tqdm=False)
    assert llm.engine.stats()["preemptions"] > 0
    assert all(check(o.outputs[0].text) for o in outs)


def test_no_step_speculates_while_a_constrained_request_is_in_the_engine(tokenized, monkeypatch):
    """Drafts do not follow the grammar's mask: while a structured-outputs request is queued or running (finished
    or aborted), no step speculates; once it is gone, steps do again."""
    llm = LLM(tokenized, **KNOBS, num_blocks=512, speculative_config={"num_speculative_tokens": 2})
    engine, proposed = llm.engine, []
    monkeypatch.setattr(engine.speculator, "choose", lambda bucket: True)
    monkeypatch.setattr(engine.speculator, "propose", lambda running: proposed.append(len(running)) or False)
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([[9, 8, 7]], plain, use_tqdm=False)
    assert proposed
    proposed.clear()
    engine.add_request([5, 6], constrained(CONSTRAINTS[1][0]), request_id="c")
    engine.add_request([4, 5], constrained(CONSTRAINTS[2][0]), request_id="gone")
    engine.abort("gone")
    llm.generate([[9, 8, 7]], plain, use_tqdm=False)   # steps the constrained request to its end as well
    assert not proposed and not engine.has_unfinished_requests()
    llm.generate([[9, 8, 7]], plain, use_tqdm=False)
    assert proposed


def test_compiled_constraints_are_cached_per_distinct_text(llm):
    """A schema as an object or as its JSON text is one grammar; its properties in another order are another (the
    order is the output's)."""
    structured, schema = llm.engine.structured, {"type": "object", "properties": {"a": {}, "b": {}}}
    a = structured.compile(SO(json=schema))
    assert structured.compile(SO(json=json.dumps(schema, indent=2))) is a
    assert structured.compile(SO(json={"type": "object", "properties": {"b": {}, "a": {}}})) is not a
    assert structured.compile(SO(json_object=True)) is not a


def test_constrained_steps_compile_nothing_after_start(tokenized):
    llm = LLM(tokenized, **{**KNOBS, "num_blocks": 512, "precompile": True})
    llm.generate([[5, 6], [7, 8]], [constrained(spec) for spec, _ in CONSTRAINTS[:2]], use_tqdm=False)
    assert llm.engine.stats()["compiles_after_start"] == 0


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3}},
    "required": ["name", "age"]}


@pytest.mark.slow
def test_the_embedded_model_answers_in_the_asked_form(smollm):
    llm = LLM(smollm, precompile=False, **SERVER_KNOBS)   # the serving tests' engine: their graphs, compiled once
    asks = [("Describe a person called Ann who is 31 and likes chess, as JSON.", SO(json=PERSON),
             lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
            ("Is the sky blue? Answer yes or no.", SO(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
            ('Answer with a JSON object with the keys "city" and "country": what is the capital of France?',
             SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
            ("Give me a date in 2024.", SO(regex=r"2024-(0[1-9]|1[0-2])-[0-2][0-9]"),
             lambda t: re.fullmatch(r"2024-(0[1-9]|1[0-2])-[0-2][0-9]", t) is not None)]
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}], True) for q, _, _ in asks]
    for temperature in (0.0, 0.8):
        params = [SamplingParams(temperature=temperature, seed=1, max_tokens=120, structured_outputs=spec)
                  for _, spec, _ in asks]
        for (_, _, check), out in zip(asks, llm.generate(prompts, params, use_tqdm=False)):
            assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text
