"""Streaming detokenization with stop strings.

Text is decoded incrementally (vLLM's prefix/read offsets): each step decodes only a small window of
tokens, the last fully emitted chunk plus the new tokens, and takes the difference of the two decodes,
so spacing that depends on the previous token stays right and the cost is O(new tokens). Nothing is
emitted while the window's text ends in U+FFFD (half a multi-byte character). Where the tokenizer's decode is
its `tokenizers.Tokenizer`'s own (no clean-up after it), the library's `DecodeStream` takes those steps in Rust,
after the same prompt context: two decodes through transformers cost ~8 us a token, ~2 ms of host time a step at
256 sequences. A half character left at the end is flushed by the window decode.

Stop strings: `text` never shows what could still turn into a stop string. The longest suffix of the
decoded text that is a proper prefix of some stop string is held back; it is released as soon as the
next characters rule the stop string out, or when the sequence finishes some other way (`finish`).
A found stop string truncates the text before it (or after it, with include_stop_str_in_output).
"""

from dataclasses import InitVar, dataclass, field

import tokenizers
from tokenizers.decoders import DecodeStream

from jaxserve.engine.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, for its leading space
REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: object  # anything with .decode(ids, skip_special_tokens=...): HF tokenizers, fast or slow
    prompt_ids: InitVar[list[int]]  # only its last tokens are kept, as context
    params: SamplingParams
    token_ids: list[int] = field(init=False)  # the last prompt tokens, then every output token
    prefix_offset: int = field(init=False)  # window start: tokens before it are never decoded again
    read_offset: int = field(init=False)  # tokens before it are in `decoded`
    decoded: str = field(init=False, default="")  # all output text so far, stop strings not yet cut
    num_emitted: int = field(init=False, default=0)  # chars of `decoded` shown in `text`
    num_output_tokens: int = field(init=False, default=0)
    stop_reason: str | None = field(init=False, default=None)  # the stop string found, once found
    backend: tokenizers.Tokenizer | None = field(init=False)  # where DecodeStream runs, else None
    stream: DecodeStream | None = field(init=False, default=None)
    num_streamed: int = field(init=False, default=0)  # tokens the stream has taken

    def __post_init__(self, prompt_ids):
        self.token_ids = list(prompt_ids[max(0, len(prompt_ids) - PROMPT_CONTEXT_TOKENS):])
        self.prefix_offset, self.read_offset = 0, len(self.token_ids)
        self.backend = rust_decoder(self.tokenizer)
        if self.backend is not None:
            self.stream = DecodeStream(skip_special_tokens=self.params.skip_special_tokens)
            self.stream_new()   # the context: its text is the prompt's, and the offsets stay where they are

    @property
    def text(self) -> str:
        """Output text safe to show: grows only, holds back a possible start of a stop string."""
        return self.decoded[: self.num_emitted]

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add generated tokens; returns the stop string if one now ends the output, else None."""
        if self.stopped:
            raise ValueError("update: this sequence already stopped at a stop string")
        self.token_ids += new_token_ids
        self.num_output_tokens += len(new_token_ids)
        old_len = len(self.decoded)
        self.decoded += self.decode_new(flush=False)
        if self.num_output_tokens >= self.params.min_tokens:  # vLLM: no stop check before min_tokens
            self.stop_reason = self.cut_at_stop(old_len)
        self.num_emitted = len(self.decoded) - (0 if self.stopped else self.held_back())
        return self.stop_reason

    def finish(self) -> str:
        """The sequence ended without a stop string (EOS, length, abort): release everything; returns text."""
        if not self.stopped:
            self.decoded += self.decode_new(flush=True)
            self.num_emitted = len(self.decoded)
        return self.text

    def decode_new(self, *, flush: bool) -> str:
        """Text of the tokens past read_offset; empty while it would end in half a character (unless flush)."""
        if self.stream is not None and not flush:
            return self.stream_new()
        window, skip = self.token_ids[self.prefix_offset:], self.params.skip_special_tokens
        prefix_text = self.tokenizer.decode(window[: self.read_offset - self.prefix_offset], skip_special_tokens=skip)
        new_text = self.tokenizer.decode(window, skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not flush):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text):]

    def stream_new(self) -> str:
        """decode_new's text by DecodeStream. A stream that refuses a token (the library raises where a decoder's
        output of the window stops extending its prefix's) hands the sequence to the window decodes, whose offsets
        are kept alike."""
        try:
            text = self.stream.step(self.backend, self.token_ids[self.num_streamed:])
            self.num_streamed = len(self.token_ids)
        except Exception:   # the library's error type is a plain Exception
            self.stream = None
            return self.decode_new(flush=False) if self.read_offset < len(self.token_ids) else ""
        if text is None or self.read_offset == len(self.token_ids):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text

    def cut_at_stop(self, old_len: int) -> str | None:
        """Truncate `decoded` at the earliest stop string that overlaps the new text; returns it."""
        found = []
        for stop in self.params.stop:
            at = self.decoded.find(stop, max(0, old_len - len(stop) + 1))
            if at >= 0:
                found.append((at, stop))
        if not found:
            return None
        at, stop = min(found, key=lambda f: f[0])  # earliest; among equals, the first listed
        self.decoded = self.decoded[: at + (len(stop) if self.params.include_stop_str_in_output else 0)]
        return stop

    def held_back(self) -> int:
        """Length of the longest suffix of `decoded` that is a proper prefix of a stop string. Per stop string, the
        tail's places holding its first character are the only candidates (mostly none): the earliest that starts
        it is its longest."""
        text, longest = self.decoded, 0
        for stop in self.params.stop:
            at = text.find(stop[0], max(0, len(text) - len(stop) + 1))
            while at >= 0 and not stop.startswith(text[at:]):
                at = text.find(stop[0], at + 1)
            if at >= 0:
                longest = max(longest, len(text) - at)
        return longest


def rust_decoder(tokenizer) -> tokenizers.Tokenizer | None:
    """The `tokenizers.Tokenizer` whose decode is the tokenizer's (transformers' tokenizers hold one and decode
    through it, cleaning up spaces after it where they are told to, except for BPE models); None for others."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        return None
    bpe = isinstance(backend.model, tokenizers.models.BPE)
    cleans = getattr(tokenizer, "clean_up_tokenization_spaces", False) and (
        not bpe or getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    return None if cleans else backend
