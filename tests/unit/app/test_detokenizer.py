"""Incremental detokenization, stop strings, text deltas (app/output.py) and prompt building
(app/chat.py), with the real SmolLM2 tokenizer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.chat import PromptBuilder, normalize_messages
from app.detokenizer import IncrementalDetokenizer
from app.errors import InvalidRequestError
from app.messages import FinishReason, TokenEvent
from app.output import GenerationFailed, GenerationOutput, text_deltas
from app.sampling import SamplingParams

REPLACEMENT = "\ufffd"

LONG_TEXT = (
    "Déjà vu: the naïve café owner served crêpes flambées to Zoë and Björn 🙂. "
    "Ünïcödé is fun 🎉👍🏽 — 日本語のテキストも大丈夫です。 Ελληνικά, русский, עברית; "
    "emoji in a row 🙂🙂🚀✨ and a family 👨‍👩‍👧 at the end… ¿Qué tal? ¡Muy bien! 🤖"
)


def _ids(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _run(tok, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, stop)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.finish())
    return deltas, detok.text


# ---- incremental detokenization ----------------------------------------------------------


def test_incremental_text_equals_full_decode(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = _ids(tok, LONG_TEXT) * 3
    deltas, text = _run(tok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert text == "".join(deltas)
    assert all(REPLACEMENT not in d for d in deltas)
    assert sum(1 for d in deltas if d) > len(ids) // 3  # streamed, not all at the end


def test_split_multibyte_characters_never_leak_replacement(smollm_tokenizer):
    tok = smollm_tokenizer
    emoji_ids = _ids(tok, "🙂")
    assert len(emoji_ids) > 1  # the premise: one character over several tokens
    assert REPLACEMENT in tok.decode(emoji_ids[:1])
    for text in ("🙂", "a🙂b", "🙂🙂🙂", "日本語🎉👍🏽"):
        ids = _ids(tok, text)
        detok = IncrementalDetokenizer(tok)
        pieces = []
        for t in ids:
            piece = detok.add(t)
            assert REPLACEMENT not in piece
            pieces.append(piece)
        pieces.append(detok.finish())
        assert "".join(pieces) == text
        # nothing was released before the first character's bytes were all there
        assert pieces[0] == "" or pieces[0] == text[: len(pieces[0])]


def test_incomplete_character_at_end_is_dropped(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = _ids(tok, "ok 🎉") + _ids(tok, "🙂")[:1]  # the stream ends mid-character
    deltas, text = _run(tok, ids)
    assert text == "ok 🎉"
    assert all(REPLACEMENT not in d for d in deltas)


def test_special_tokens_skipped(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = [*_ids(tok, "Hello"), tok.eos_token_id]
    _, text = _run(tok, ids)
    assert text == "Hello"


# ---- stop strings ------------------------------------------------------------------------


def _check_stop(tok, text: str, stop: tuple[str, ...], expected: str) -> list[str]:
    ids = _ids(tok, text)
    detok = IncrementalDetokenizer(tok, stop)
    deltas = []
    for t in ids:
        deltas.append(detok.add(t))
        # no prefix of any emitted text ever holds a stop string
        assert not any(s in detok.text for s in stop)
    deltas.append(detok.finish())
    assert detok.stopped
    assert "".join(deltas) == expected == detok.text
    assert detok.add(ids[0]) == "" and detok.finish() == ""  # nothing after a stop
    return deltas


def test_stop_string_spanning_tokens(smollm_tokenizer):
    tok = smollm_tokenizer
    text = "Hello there, general Kenobi! You are a bold one."
    stop = "general Kenobi"
    pieces = [tok.decode([t]) for t in _ids(tok, text)]
    assert not any(stop in p for p in pieces)  # the premise: no single token holds it
    _check_stop(tok, text, (stop,), "Hello there, ")


def test_stop_string_of_split_emoji(smollm_tokenizer):
    tok = smollm_tokenizer
    text = "party 🎉👍🏽 time"
    assert len(_ids(tok, "👍")) > 1
    _check_stop(tok, text, ("👍",), "party 🎉")


def test_earliest_of_several_stop_strings_wins(smollm_tokenizer):
    tok = smollm_tokenizer
    text = "one two three four five six"
    _check_stop(tok, text, ("five", " three f"), "one two")
    _check_stop(tok, text, ("one",), "")  # right at the start: no text at all


def test_partial_stop_match_is_released_in_the_end(smollm_tokenizer):
    tok = smollm_tokenizer
    text = "the quick brown fox jumps over the lazy dog"
    ids = _ids(tok, text)
    detok = IncrementalDetokenizer(tok, ("the lazy cat",))
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) != text  # the tail that could start a stop string is held back
    deltas.append(detok.finish())
    assert not detok.stopped
    assert "".join(deltas) == text


# ---- text_deltas -------------------------------------------------------------------------


class _Source:
    """An async generator of token events that records how far it was read and if closed."""

    def __init__(self, ids: list[int], finish: str | None = "length", error_at: int | None = None):
        self.ids, self.finish, self.error_at = ids, finish, error_at
        self.pulled = 0
        self.closed = False

    async def events(self):
        try:
            for i, t in enumerate(self.ids):
                self.pulled += 1
                if i == self.error_at:
                    yield TokenEvent("r", None, i, FinishReason.ERROR, error="boom")
                    return
                last = i == len(self.ids) - 1
                yield TokenEvent("r", t, i, self.finish if last else None)
        finally:
            self.closed = True


async def _collect(source: _Source, tok, sampling: SamplingParams) -> GenerationOutput:
    out = GenerationOutput("r", [1, 2])
    async for d in text_deltas(source.events(), tok, sampling):
        assert out.finish_reason is None  # nothing after the final delta
        out.text += d.text
        out.token_ids.extend(d.token_ids)
        out.finish_reason = d.finish_reason
    return out


async def test_text_deltas_full_stream(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = _ids(tok, LONG_TEXT)
    src = _Source(ids)
    out = await _collect(src, tok, SamplingParams())
    assert out.text == tok.decode(ids)
    assert out.token_ids == ids
    assert out.finish_reason == "length"
    assert out.usage == {"prompt_tokens": 2, "completion_tokens": len(ids),
                         "total_tokens": 2 + len(ids)}
    assert src.closed and src.pulled == len(ids)


async def test_text_deltas_closes_source_on_stop(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = _ids(tok, "Hello there, general Kenobi! You are a bold one. And more text follows.")
    src = _Source(ids)
    out = await _collect(src, tok, SamplingParams(stop=("Kenobi",)))
    assert out.text == "Hello there, general "
    assert out.finish_reason == "stop"
    assert src.closed
    assert src.pulled < len(ids)  # closed early, not run to its end
    assert out.token_ids == ids[: src.pulled]


async def test_text_deltas_errors(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = _ids(tok, "some words here")
    src = _Source(ids, error_at=1)
    with pytest.raises(GenerationFailed, match="boom"):
        await _collect(src, tok, SamplingParams())
    assert src.closed
    src = _Source(ids, finish=None)  # the stream ends without saying why
    with pytest.raises(GenerationFailed, match="without a finish reason"):
        await _collect(src, tok, SamplingParams())


# ---- min_tokens holds stop strings off (vLLM's rule) -------------------------------------


class _Pieces:
    """A tokenizer whose tokens 0 to 5 read "ab", "c", "ab", "x", "ab", "y"."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(("ab", "c", "ab", "x", "ab", "y")[i] for i in ids)


@pytest.mark.parametrize(("min_tokens", "text", "stopped"), [
    (0, "", True),  # no min_tokens: the first "ab" stops
    (1, "abc", True),  # token 0's "ab" is held off, token 2's stops
    (2, "abc", True),
    (3, "abcabx", True),  # tokens 0..2 held off, token 4's "ab" stops
    (5, "abcabxaby", False),  # every "ab" is within the first 5 tokens
])
def test_min_tokens_holds_off_stop_strings_ending_in_its_tokens(min_tokens, text, stopped):
    """As vLLM: a stop string counts only when it ends in the text of a token past the
    first ``min_tokens``."""
    detok = IncrementalDetokenizer(_Pieces(), ("ab",), min_tokens=min_tokens)
    out = "".join(detok.add(t) for t in range(6)) + detok.finish()
    assert (out, detok.text, detok.stopped) == (text, text, stopped)


def test_a_stop_string_may_begin_in_the_min_tokens_text_and_end_after_it():
    detok = IncrementalDetokenizer(_Pieces(), ("ca",), min_tokens=2)  # "c" is token 1's
    out = "".join(detok.add(t) for t in range(6)) + detok.finish()
    assert (out, detok.stopped) == ("ab", True)
    # ending within them, it does not count
    detok = IncrementalDetokenizer(_Pieces(), ("bc",), min_tokens=2)
    out = "".join(detok.add(t) for t in range(6)) + detok.finish()
    assert (out, detok.stopped) == ("abcabxaby", False)


def test_min_tokens_counts_the_streams_index_not_the_tokens_fed():
    """A stream whose events start past index 0 (its earlier tokens were counted already)
    is past its min_tokens sooner."""
    detok = IncrementalDetokenizer(_Pieces(), ("ab",), min_tokens=3)
    assert detok.add(0, index=3) == "" and detok.stopped


async def test_text_deltas_hold_stop_strings_off_until_min_tokens_and_to_the_end():
    """The stream ends (length) at exactly min_tokens tokens: its held-back tail is released
    whole, a stop string in it included."""
    tok = _Pieces()
    out = await _collect(_Source([0, 1, 2, 3]), tok, SamplingParams(stop=("ab",), min_tokens=1))
    assert (out.text, out.finish_reason) == ("abc", "stop")
    out = await _collect(_Source([0, 1, 2]), tok, SamplingParams(stop=("ab",), min_tokens=3))
    assert (out.text, out.finish_reason) == ("abcab", "length")


# ---- chat / prompt building --------------------------------------------------------------


def test_encode_chat_applies_template(smollm_tokenizer):
    pb = PromptBuilder(smollm_tokenizer)
    assert pb.vocab_size == 49152
    ids = pb.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    text = smollm_tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")  # generation prompt added
    im_start = smollm_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == text.count("<|im_start|>")  # special tokens, not spelled out

    text = pb.chat_text([
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                     {"type": "text", "text": "there"}]},
    ])
    assert "<|im_start|>system\nBe terse.<|im_end|>" in text
    assert "<|im_start|>user\nHi there<|im_end|>" in text


def test_normalize_messages_errors():
    with pytest.raises(InvalidRequestError, match="at least one message") as info:
        normalize_messages([])
    assert info.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="role must be one of") as info:
        normalize_messages([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    assert info.value.param == "messages[1].role"
    with pytest.raises(InvalidRequestError, match="only text content parts") as info:
        normalize_messages([{"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "http://x"}}]}])
    assert info.value.param == "messages[0].content"
    with pytest.raises(InvalidRequestError, match="must be a string or a list") as info:
        normalize_messages([{"role": "user", "content": 42}])
    assert info.value.param == "messages[0].content"
    assert normalize_messages([{"role": "assistant"}]) == [{"role": "assistant", "content": ""}]


def test_prompt_builder_prompts_and_eos(smollm_tokenizer):
    pb = PromptBuilder(smollm_tokenizer)
    assert pb.encode_prompt("Hello world") == list(smollm_tokenizer.encode("Hello world"))
    assert pb.encode_prompt([5, 6, 7]) == [5, 6, 7]
    with pytest.raises(InvalidRequestError, match="list of integers"):
        pb.encode_prompt([5, True])
    with pytest.raises(InvalidRequestError, match="string or a list"):
        pb.encode_prompt(3.5)  # type: ignore[arg-type]
    assert pb.eos_token_ids() == frozenset({2})
    assert pb.eos_token_ids(SimpleNamespace(eos_token_id=[2, 0])) == frozenset({0, 2})
    assert pb.eos_token_ids(SimpleNamespace(eos_token_id=7)) == frozenset({2, 7})

    class NoTemplate:
        chat_template = None

        def __len__(self) -> int:
            return 10

    with pytest.raises(InvalidRequestError, match="no chat template"):
        PromptBuilder(NoTemplate()).chat_text([{"role": "user", "content": "hi"}])
