"""Per-request generation parameters, named and validated like vLLM's `SamplingParams` (and its
`StructuredOutputsParams`)."""
from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field, replace

import numpy as np

MAX_LOGPROBS = 20  # most top-N logprobs a request may ask for (per token, and per prompt token)
GREEDY_TEMPERATURE = 1e-5  # below this a request is sampled greedily (argmax)
SEED_RANGE = (-(2**63), 2**63)  # int64, like vLLM's OpenAI front end
INT32_MAX = 2**31 - 1  # counts and ids reach the device as int32
# Bounded per-token work: every stop string is searched in each new token's text, every stop id masked in-graph.
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 64, 1024, 16
# Float ranges that stay finite and nonzero in float32, where the sampler computes: past them sampling is
# already uniform (temperature) or a penalty already decides every logit.
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (1e-3, 1e3)

INT_FIELDS = ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
OPTIONAL_FIELDS = ("max_tokens", "logprobs", "prompt_logprobs", "seed")
# The fields a model's generation_config sets for the requests that leave them unset (None), and vLLM's values,
# which they take where it sets none. Its max_new_tokens is its "max_tokens": the bound of a request whose max_tokens
# is None (vLLM's `--generation-config auto`).
VLLM_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
DEFAULT_MAX_TOKENS = 16   # vLLM's
# A schema, regex or grammar is compiled on the host per distinct text: bounded like any other request field.
MAX_STRUCTURED_CHARS = 64 * 1024
MAX_CHOICES = 1024
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one constraint on the output (vLLM's fields): `json` a JSON schema (a dict, or its JSON text),
    `json_object` any JSON object, `regex` a regular expression the whole output matches, `choice` one of these
    strings, `grammar` a context-free grammar (Lark syntax, or GBNF: rules written with ::=)."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [k for k in STRUCTURED_KINDS if (self.json_object is not False if k == "json_object"
                                                 else getattr(self, k) is not None)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {short(self.json_object)}")
        if self.json is not None:
            self.json = parse_schema(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {short(value)}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or len(self.choice) > MAX_CHOICES \
                    or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty strings, "
                                 f"got {short(self.choice)}")
            self.choice = list(self.choice)
        kind, text = self.key
        if len(text) > MAX_STRUCTURED_CHARS:
            raise ValueError(f"structured_outputs.{kind}: {len(text):,} characters; at most {MAX_STRUCTURED_CHARS:,}")
        check_text(f"structured_outputs.{kind}", text)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, its text, canonical): what a compiled grammar is cached by."""
        if self.json is not None:
            return "json", json.dumps(self.json, separators=(",", ":"))   # key order is output order
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


def parse_schema(schema) -> dict:
    """A JSON schema given as an object or as JSON text; a ValueError naming the field otherwise."""
    if isinstance(schema, str):
        if len(schema) > MAX_STRUCTURED_CHARS:
            raise ValueError(f"structured_outputs.json: {len(schema):,} characters; at most "
                             f"{MAX_STRUCTURED_CHARS:,}")
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {short(schema)}")
    return schema


class RequestOutputKind(enum.Enum):
    """Which outputs a request gets from the engine's steps (vLLM's names): CUMULATIVE, one per step that gave it
    tokens, with everything so far (streaming); FINAL_ONLY, one when it finishes (batch generation: no output is
    built for the steps in between)."""
    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    """temperature, top_p, top_k, min_p and repetition_penalty left None take the serving model's defaults (its
    generation_config; the engine applies them, `with_defaults`), else vLLM's. They read back as vLLM's at once, so
    a SamplingParams is whole without a model; `unset` names them. (dataclasses.replace builds anew: a field it
    copies counts as set.)"""
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1: off
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    ignore_eos: bool = False
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: up to the model's max length
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    unset: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self):
        self.unset = frozenset(name for name in VLLM_DEFAULTS if getattr(self, name) is None)
        for name in self.unset:
            setattr(self, name, VLLM_DEFAULTS[name])
        check_types(self)
        self.stop = normalise_stop(self.stop)
        self.stop_token_ids = normalise_stop_token_ids(self.stop_token_ids)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {short(self.output_kind)}")
        check_ranges(self)

    def with_defaults(self, defaults: dict, room: int) -> SamplingParams:
        """These params with a model's defaults (VLLM_DEFAULTS' fields, max_tokens) in their unset fields; its
        max_tokens bounds a max_tokens of None, to at most `room` (what the prompt leaves of max_model_len: a default
        the request never asked for must not make it too long)."""
        changes = {name: defaults[name] for name in self.unset if name in defaults}
        if self.max_tokens is None and "max_tokens" in defaults:
            changes["max_tokens"] = max(1, min(defaults["max_tokens"], room))
        return replace(self, **changes) if changes else self


def default_max_tokens(model_defaults: dict, otherwise: int | None) -> int | None:
    """A request's max_tokens when it gives none: None where the model has a max_new_tokens (the engine bounds it by
    that and by the room the prompt leaves, `with_defaults`), else the surface's own default."""
    return None if "max_tokens" in model_defaults else otherwise


def check_types(p: SamplingParams) -> None:
    """Reject wrong types (bool is an int in Python, but never a count or a float here); ints become floats."""
    for name in INT_FIELDS + FLOAT_FIELDS + BOOL_FIELDS:
        value = getattr(p, name)
        if value is None and name in OPTIONAL_FIELDS:
            continue
        if name in BOOL_FIELDS:
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, int if name in INT_FIELDS else (int, float)) and not isinstance(value, bool)
        if not ok:
            kind = "a bool" if name in BOOL_FIELDS else "an int" if name in INT_FIELDS else "a number"
            raise ValueError(f"{name} must be {kind}, got {short(value)}")
        if name in FLOAT_FIELDS:
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
            setattr(p, name, float(value))


def normalise_stop(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty str or a list of non-empty str, got {short(stop)}")
    if len(stops) > MAX_STOP_STRINGS or max(map(len, stops), default=0) > MAX_STOP_CHARS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters, got "
                         f"{len(stops)} (longest {max(map(len, stops))})")
    for s in stops:
        check_text("stop", s)
    return list(stops)


def normalise_stop_token_ids(ids) -> list[int]:
    ids = [] if ids is None else ids
    if not isinstance(ids, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= INT32_MAX for i in ids
    ):
        raise ValueError(f"stop_token_ids must be a list of token ids (ints in [0, 2**31)), got {short(ids)}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    return list(ids)


def check_text(name: str, text: str) -> bytes:
    """Text that is valid Unicode (JSON's "\\ud800" escapes give lone surrogates, which no encoder, tokenizer or hash
    takes), as UTF-8: a ValueError naming the field, where the request arrives, never later on the engine's thread."""
    try:
        return text.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: not valid Unicode (a lone surrogate at character {e.start})") from None


def short(value, limit: int = 80) -> str:
    """repr of a bad value, cut: error messages stay one readable line whatever the client sent."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def check_ranges(p: SamplingParams) -> None:
    checks = (
        ("n", 1 <= p.n <= INT32_MAX, "must be >= 1"),
        ("temperature", 0.0 <= p.temperature <= MAX_TEMPERATURE, f"must be in [0, {MAX_TEMPERATURE:g}]"),
        ("top_p", 0.0 < p.top_p <= 1.0 and np.float32(p.top_p) > 0, "must be in (0, 1] (and above 0 in float32)"),
        ("top_k", -1 <= p.top_k <= INT32_MAX, "must be -1, 0 (off) or positive, below 2**31"),
        ("min_p", 0.0 <= p.min_p <= 1.0, "must be in [0, 1]"),
        ("repetition_penalty", REPETITION_PENALTY_RANGE[0] <= p.repetition_penalty <= REPETITION_PENALTY_RANGE[1],
         "must be in [{:g}, {:g}]".format(*REPETITION_PENALTY_RANGE)),
        ("presence_penalty", -2.0 <= p.presence_penalty <= 2.0, "must be in [-2, 2]"),
        ("frequency_penalty", -2.0 <= p.frequency_penalty <= 2.0, "must be in [-2, 2]"),
        ("max_tokens", p.max_tokens is None or 1 <= p.max_tokens <= INT32_MAX, "must be in [1, 2**31) or None"),
        ("min_tokens", 0 <= p.min_tokens <= INT32_MAX, "must be in [0, 2**31)"),
        ("min_tokens", p.max_tokens is None or p.min_tokens <= p.max_tokens, "must be <= max_tokens"),
        ("logprobs", p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]"),
        ("prompt_logprobs", p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= MAX_LOGPROBS,
         f"must be in [0, {MAX_LOGPROBS}]"),
        ("seed", p.seed is None or SEED_RANGE[0] <= p.seed < SEED_RANGE[1], "must fit in int64"),
    )
    for name, ok, rule in checks:
        if not ok:
            raise ValueError(f"{name} {rule}, got {short(getattr(p, name))}")
