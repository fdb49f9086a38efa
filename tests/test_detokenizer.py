"""Streaming detokenization and stop strings, with tiny tokenizers trained offline in the test."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.sampling_params import SamplingParams

CORPUS = ["Hello world, this is a tiny corpus.", "café crème brûlée à la carte", "中文 字符 测试 中文",
          "emoji 😀 🎉 done", "STOP here ### end of text", "Hi there, the world is wide"] * 20
EOS = "<|endoftext|>"


def train(pre_tokenizer, decoder, **trainer_kw) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=[EOS], show_progress=False,
                                                        **trainer_kw))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


@pytest.fixture(scope="module")
def gpt2_like():
    """Byte-level BPE: characters outside the corpus (日本, most emoji) split into one token per byte."""
    return train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


@pytest.fixture(scope="module")
def sentencepiece_like():
    """Metaspace: a word's leading space is part of its token and dropped when the token is decoded first."""
    return train(pre_tokenizers.Metaspace(), decoders.Metaspace())


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def stream(tok, prompt, output, **params):
    """Feed output (text or ids) one token at a time; returns the detokenizer and the text after each token."""
    detok = IncrementalDetokenizer(tok, encode(tok, prompt), SamplingParams(**params))
    ids = encode(tok, output) if isinstance(output, str) else output
    texts = []
    for token in ids:
        detok.update([token])
        texts.append(detok.text)
        if detok.stopped:
            break
    return detok, texts


def assert_streams_safely(texts, final):
    """Text only grows, is always a prefix of the final text, and never shows half a character."""
    for before, after in zip([""] + texts, texts):
        assert after.startswith(before)
    assert all(final.startswith(t) and "\ufffd" not in t for t in texts)


MIXED = ["Hello 中文 😀 café", "日本語 🐍🦀 naïve — ok", "a", "   spaced   out  ", "🎉🎉🎉", "crème 中 字符 brûlée"]


@pytest.mark.parametrize("text", MIXED)
def test_deltas_concatenate_to_full_decode(gpt2_like, text):
    detok, texts = stream(gpt2_like, "Hi there", text)
    assert detok.finish() == gpt2_like.decode(encode(gpt2_like, text)) == text
    assert_streams_safely(texts, text)


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="ab c,中文日本😀🎉éà\n", max_size=24), st.text(alphabet="xy 中😀", max_size=6))
def test_any_text_streams_back_exactly(gpt2_like, text, prompt):
    detok, texts = stream(gpt2_like, prompt, text)
    assert detok.finish() == text
    assert_streams_safely(texts, text)


def test_leading_space_of_first_output_token_kept(sentencepiece_like):
    tok = sentencepiece_like
    output = encode(tok, "Hi there world")[len(encode(tok, "Hi")):]
    assert tok.decode(output) == "there world"  # decoded alone, the first token loses its space
    detok, texts = stream(tok, "Hi", output)
    assert detok.finish() == " there world"
    assert_streams_safely(texts, " there world")


def test_half_character_waits_for_the_rest(gpt2_like):
    ids = encode(gpt2_like, "日")
    assert len(ids) == 3  # one byte per token: the first two decode to U+FFFD
    _, texts = stream(gpt2_like, "x", ids)
    assert texts == ["", "", "日"]
    cut_short, texts = stream(gpt2_like, "x", encode(gpt2_like, "ab") + ids[:2])
    assert texts[-1] == "ab" and cut_short.finish() == gpt2_like.decode(encode(gpt2_like, "ab") + ids[:2])
    assert cut_short.text.startswith("ab\ufffd")  # an unfinished character still shows at the end, as in decode


@pytest.mark.parametrize("stop", ["###", "中文!", "orld, th", "é😀"])
def test_stop_string_split_across_tokens_is_cut_and_never_shown(gpt2_like, stop):
    output = f"Hello there {stop} and after"
    ids = encode(gpt2_like, output)
    assert not any(stop in gpt2_like.decode([i]) for i in ids)  # it spans several tokens
    detok, texts = stream(gpt2_like, "Q:", ids, stop=["zzz", stop])
    assert detok.stop_reason == stop and detok.text == "Hello there "
    assert_streams_safely(texts, "Hello there ")
    assert detok.finish() == "Hello there "  # nothing after the stop comes back


def test_include_stop_str_in_output(gpt2_like):
    detok, texts = stream(gpt2_like, "Q:", "say ### more text", stop="###", include_stop_str_in_output=True)
    assert detok.stop_reason == "###" and detok.text == "say ###"
    assert_streams_safely(texts, "say ###")


def test_earliest_stop_string_wins(gpt2_like):
    detok = IncrementalDetokenizer(gpt2_like, [], SamplingParams(stop=["three", "two"]))
    assert detok.update(encode(gpt2_like, "one two three four")) == "two"  # both arrive in one update
    assert detok.text == "one "


def test_hold_back_released_when_not_a_stop(gpt2_like):
    tok = gpt2_like
    detok = IncrementalDetokenizer(tok, encode(tok, "Q"), SamplingParams(stop=["abcd"]))
    shown = []
    for piece in ["x", "a", "b", "c", "e", " ab"]:
        detok.update(encode(tok, piece))
        shown.append(detok.text)
    assert shown == ["x", "x", "x", "x", "xabce", "xabce "]
    assert detok.finish() == "xabce ab"  # a finish other than a stop string releases the held-back tail
    assert detok.stop_reason is None


def test_stop_strings_ignored_before_min_tokens(gpt2_like):
    tok = gpt2_like
    first_end = len(encode(tok, "END"))  # the first END is complete one token before min_tokens
    detok, _ = stream(tok, "", "END x END y", stop="END", min_tokens=first_end + 1)
    assert detok.stop_reason == "END" and detok.text == "END x "


def test_special_tokens_skipped_or_kept(gpt2_like):
    tok = gpt2_like
    ids = encode(tok, "ab") + [tok.eos_token_id] + encode(tok, "cd")
    assert stream(tok, "", ids)[0].finish() == "abcd"
    assert stream(tok, "", ids, skip_special_tokens=False)[0].finish() == f"ab{EOS}cd"


def test_update_after_stop_is_an_error(gpt2_like):
    detok, _ = stream(gpt2_like, "", "a ### b", stop="###")
    with pytest.raises(ValueError, match="update"):
        detok.update([5])


def test_each_step_decodes_a_small_window(gpt2_like):
    """O(new tokens) per step: the decoded windows stay short however long the sequence grows."""
    windows = []

    class Recording:
        def decode(self, ids, skip_special_tokens):
            windows.append(len(ids))
            return gpt2_like.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "Hello world, 中文 😀 café " * 40
    detok = IncrementalDetokenizer(Recording(), encode(gpt2_like, "prompt " * 50), SamplingParams(stop="###"))
    for token in encode(gpt2_like, text):
        detok.update([token])
    assert detok.finish() == text
    assert max(windows) <= 10 and len(windows) <= 2 * len(encode(gpt2_like, text)) + 2


class WindowOnly:
    """The tokenizer behind its decode only: the detokenizer then decodes windows itself (no DecodeStream)."""

    def __init__(self, tok):
        self.decode, self.encode = tok.decode, tok   # encode: what `stream` calls for the prompt

    def __call__(self, text, **kw):
        return self.encode(text, **kw)


def test_fast_tokenizers_stream_in_rust(gpt2_like, sentencepiece_like):
    for tok in (gpt2_like, sentencepiece_like):
        assert IncrementalDetokenizer(tok, [], SamplingParams()).stream is not None
    assert IncrementalDetokenizer(WindowOnly(gpt2_like), [], SamplingParams()).stream is None


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="ab c,中文日本😀🎉éà\n#", max_size=24), st.text(alphabet="xy 中😀", max_size=6),
       st.sampled_from([None, "#", "中文", "b c"]))
def test_stream_shows_what_the_window_decodes_show(gpt2_like, text, prompt, stop):
    """Token by token, DecodeStream's text (held back for stop strings alike) is the window decodes' text."""
    streamed, streamed_texts = stream(gpt2_like, prompt, text, stop=stop)
    windowed, windowed_texts = stream(WindowOnly(gpt2_like), prompt, encode(gpt2_like, text), stop=stop)
    assert streamed_texts == windowed_texts
    assert streamed.finish() == windowed.finish() and streamed.stop_reason == windowed.stop_reason


def test_a_refused_stream_step_goes_on_by_windows(gpt2_like):
    """Where the library's stream raises (it refuses a window whose text stops extending its prefix's), the
    sequence goes on by the window decodes from where the stream left it."""
    text = "Hello 中文 😀 café, the world is wide"
    ids = encode(gpt2_like, text)
    detok = IncrementalDetokenizer(gpt2_like, encode(gpt2_like, "Hi"), SamplingParams())

    class Refusing:
        def step(self, tokenizer, ids):
            raise Exception("Invalid prefix encountered")

    for i, token in enumerate(ids):
        if i == 5:
            detok.stream = Refusing()
        detok.update([token])
    assert detok.stream is None and detok.finish() == text


def test_decoders_that_clean_up_spaces_keep_the_window_decodes():
    """transformers cleans up spaces after a WordPiece tokenizer's decode when told to (not after BPE's): those
    keep decoding through transformers, whose text is what the user asked for."""
    from jaxserve.engine.detokenizer import rust_decoder
    vocab = {"[UNK]": 0, "hello": 1, ",": 2, "world": 3}
    word_piece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    word_piece.decoder = decoders.WordPiece()
    for clean_up in (True, False):
        tok = PreTrainedTokenizerFast(tokenizer_object=word_piece, clean_up_tokenization_spaces=clean_up)
        assert (rust_decoder(tok) is None) == clean_up
    bpe = train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())
    bpe.clean_up_tokenization_spaces = True
    assert rust_decoder(bpe) is not None


class CharTokenizer:
    """A character a token, its decode only (the window decodes)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab#", max_size=12), st.lists(st.text(alphabet="ab#", min_size=1, max_size=5), min_size=1,
                                                      max_size=3))
def test_held_back_is_the_longest_tail_that_starts_a_stop(decoded, stops):
    detok = IncrementalDetokenizer(CharTokenizer(), [], SamplingParams(stop=stops))
    detok.decoded = decoded
    brute = max((n for s in stops for n in range(1, len(s)) if n <= len(decoded) and decoded.endswith(s[:n])),
                default=0)
    assert detok.held_back() == brute
