"""Structured outputs: a request's constraint (StructuredOutputsParams) compiled by llguidance into a grammar matcher
per sequence. Each step that samples a constrained row, the matchers fill a token bitmask [S, ceil(V / 32)] (int32,
bit t of word t // 32: token t allowed) that the sampler graph applies; they advance on the sampled tokens.

llguidance rather than xgrammar (benchmarks/NOTES_structured.md): it needs no PyTorch at run time, compiles a new
schema in about a millisecond (its lexer and parser are built lazily, as tokens need them) and fills masks in
parallel in Rust. A compiled grammar is a template matcher, cached per distinct constraint (bounded, least recently
used first out) and copied for each sequence; front ends compile on their tokenizer thread, off the engine's."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np

from jaxserve.engine.sampling_params import StructuredOutputsParams

GRAMMAR_CACHE_SIZE = 512   # distinct constraints whose compiled grammar is kept
# Generated JSON is compact with OpenAI's separators: free whitespace lets a small model emit newlines forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for a constraint."""
    matcher = llguidance.LLMatcher
    kind, _ = spec.key
    if kind == "json":
        return matcher.grammar_from_json_schema(strict_schema(spec.json), defaults=JSON_OPTIONS)
    if kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    # Lark as it is, GBNF (rules written with ::=) converted: a ValueError where it cannot be
    return llguidance.grammar_from("grammar", spec.grammar)


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
                 "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def strict_schema(schema):
    """The schema with `additionalProperties: false` on every object schema that lists its properties and says
    nothing of others (OpenAI's strict mode, xgrammar's default): generation then sticks to the declared fields."""
    if not isinstance(schema, dict):
        return schema
    out = {key: value for key, value in schema.items()}
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub) for sub in out[key]]
    for key in SCHEMA_VALUES:
        if key in out:
            out[key] = strict_schema(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class StructuredOutputs:
    """The engine's grammar compiler and mask filler, over its tokenizer; thread-safe where front ends call it
    (`compile`, `matcher`)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self.words = -(-vocab_size // 32)
        self._lock = threading.Lock()
        self._tokenizer = None   # llguidance's view of the vocabulary, built on first use (about a second)
        self._executor = None
        self._templates: OrderedDict[tuple[str, str], object] = OrderedDict()

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            if self.hf_tokenizer is None:
                raise ValueError("structured_outputs: this model has no tokenizer to constrain")
            import llguidance.hf   # imports transformers (~1.4 s): only once a request is constrained
            # a tokenizer may name ids past the model's vocabulary (which the mask's width leaves out)
            self._tokenizer = llguidance.hf.from_tokenizer(
                self.hf_tokenizer, n_vocab=max(self.vocab_size, len(self.hf_tokenizer)),
                eos_token=self.eos_token_ids[0])
            self._executor = llguidance.LLExecutor()
        return self._tokenizer

    def compile(self, spec: StructuredOutputsParams):
        """The constraint's template matcher, compiled once; an invalid one is a ValueError naming the field."""
        with self._lock:
            if (template := self._templates.get(spec.key)) is not None:
                self._templates.move_to_end(spec.key)
                return template
            tokenizer = self._llg_tokenizer()
        kind = spec.key[0]
        try:
            template = llguidance.LLMatcher(tokenizer, grammar_text(spec), log_level=0)
        except ValueError as e:   # grammar_from_* on malformed input
            raise ValueError(f"structured_outputs.{kind}: {first_line(str(e))}") from None
        if template.is_error():
            raise ValueError(f"structured_outputs.{kind}: {first_line(template.get_error())}")
        with self._lock:
            self._templates[spec.key] = template
            while len(self._templates) > GRAMMAR_CACHE_SIZE:
                self._templates.popitem(last=False)
        return template

    def matcher(self, spec: StructuredOutputsParams):
        """A fresh matcher of the constraint, at the start of the output."""
        return self.compile(spec).deep_copy()

    def advance(self, pairs: list[tuple]) -> list[bool]:
        """Each (matcher, token): the matcher takes the token (False: the token breaks its grammar); in parallel."""
        return self._executor.consume_token_par(pairs) if pairs else []

    def fill(self, matchers: Sequence, num_rows: int) -> np.ndarray:
        """The bitmask [num_rows, words] of a step's rows: each matcher's allowed tokens on its row (the model's
        other EOS ids with its EOS), every token on the others (None: unconstrained row, and padding)."""
        bitmask = np.full((num_rows, -(-self._tokenizer.vocab_size // 32)), -1, np.int32)
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None and not m.is_stopped()]
        if rows:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, bitmask)
        if bitmask.shape[1] != self.words:   # the tokenizer's ids past the model's vocabulary
            bitmask = np.ascontiguousarray(bitmask[:, :self.words])
        for i, m in enumerate(matchers):
            if m is not None and m.is_stopped():   # finished this step (async: its row was scheduled before)
                bitmask[i] = 0
                bitmask[i, self.eos_token_ids[0] >> 5] |= bit(self.eos_token_ids[0])
        eos, *others = self.eos_token_ids
        ends = [i for _, i in rows if bitmask[i, eos >> 5] & bit(eos)]
        for t in others:
            bitmask[ends, t >> 5] |= bit(t)
        return bitmask


def bit(token: int) -> np.int32:
    """Token's bit in its int32 word of a bitmask."""
    return np.uint32(1 << (token & 31)).view(np.int32)


def first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "invalid"
