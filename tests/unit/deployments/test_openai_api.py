"""Answers in OpenAI's shape: several choices (n), streamed chunks per choice, the merge of
several answer streams, logprobs (chat and completions shapes), and the sampling fields'
validation."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from app.errors import InvalidRequestError
from app.messages import FinishReason, TokenEvent
from app.output import LogprobText, StreamDelta, text_deltas
from app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    Endpoint,
    StreamChunk,
)
from app.sampling import SamplingParams, TokenLogprobs
from deployments.openai_api import completion_body, merge_streams, stream_chunks, validation_error


async def _items(values, delay=0.0, fail_at=None, closed=None):
    try:
        for i, v in enumerate(values):
            if i == fail_at:
                raise RuntimeError("boom")
            await asyncio.sleep(delay)
            yield v
    finally:
        if closed is not None:
            closed.append(values)


def test_merge_interleaves_every_stream_and_ends_with_the_last():
    async def run():
        return [x async for x in merge_streams([_items("abc", 0.01), _items("xy", 0.015)])]
    out = asyncio.run(run())
    assert sorted(out) == [(0, "a"), (0, "b"), (0, "c"), (1, "x"), (1, "y")]
    assert [v for k, v in out if k == 0] == ["a", "b", "c"]  # each stream keeps its order
    assert out[:2] == [(0, "a"), (1, "x")]  # interleaved, not one after the other


def test_merge_stops_every_stream_at_the_first_error():
    closed: list = []

    async def run():
        async for _ in merge_streams([_items("abcdef", 0.01, closed=closed),
                                      _items("xy", 0.001, fail_at=1, closed=closed)]):
            pass
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(run())
    assert sorted(closed) == ["abcdef", "xy"]  # the slow stream was closed, not left running


def test_several_choices_in_a_body_and_in_chunks():
    body = completion_body(Endpoint.CHAT, "id1", "m", [("one", FinishReason.STOP),
                                                       ("two", FinishReason.LENGTH)], 5, 7)
    CompletionResponse.model_validate(body)
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [
        (0, "one"), (1, "two")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}

    async def deltas():
        yield 1, StreamDelta("he", [1], None)
        yield 0, StreamDelta("", [2], None)
        yield 1, StreamDelta("y", [3], FinishReason.LENGTH)
        yield 0, StreamDelta("ok", [4], FinishReason.STOP)

    async def run():
        return [c async for c in stream_chunks(Endpoint.CHAT, "id1", "m", 5, deltas(), True)]
    chunks = asyncio.run(run())
    firsts = [c["choices"][0] for c in chunks[:2]]
    # each choice's first chunk carries the role, even an empty one
    assert [(f["index"], f["delta"]) for f in firsts] == [
        (1, {"role": "assistant", "content": "he"}), (0, {"role": "assistant", "content": ""})]
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["choices"] == []


class _Tok:
    """A tokenizer whose token i reads "<i>"."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def _lp(token_id: int, logprob: float, *top: tuple[int, float]) -> TokenLogprobs:
    return TokenLogprobs(token_id, logprob, tuple(top))


def test_logprobs_in_whole_bodies_have_openai_shapes():
    entries = [LogprobText.of(_lp(7, -0.5, (7, -0.5), (9, -1.5)), _Tok()),
               LogprobText.of(_lp(3, -2.0, (4, -0.25), (3, -2.0)), _Tok())]
    chat = completion_body(Endpoint.CHAT, "c", "m", [("<7><3>", FinishReason.LENGTH)], 4, 2,
                           [entries])
    CompletionResponse.model_validate(chat)
    [first, second] = chat["choices"][0]["logprobs"]["content"]
    assert first == {"token": "<7>", "logprob": -0.5, "bytes": list(b"<7>"),
                     "top_logprobs": [{"token": "<7>", "logprob": -0.5, "bytes": list(b"<7>")},
                                      {"token": "<9>", "logprob": -1.5, "bytes": list(b"<9>")}]}
    assert [t["token"] for t in second["top_logprobs"]] == ["<4>", "<3>"]

    text = completion_body(Endpoint.COMPLETION, "t", "m", [("<7><3>", FinishReason.LENGTH)],
                           4, 2, [entries])
    CompletionResponse.model_validate(text)
    assert text["choices"][0]["logprobs"] == {
        "tokens": ["<7>", "<3>"], "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"<7>": -0.5, "<9>": -1.5}, {"<4>": -0.25, "<3>": -2.0}],
        "text_offset": [0, 3]}
    # logprobs=0: only the chosen token in top_logprobs
    zero = completion_body(Endpoint.COMPLETION, "t", "m", [("<5>", None)], 1, 1,
                           [[LogprobText.of(_lp(5, -0.1), _Tok())]])
    assert zero["choices"][0]["logprobs"]["top_logprobs"] == [{"<5>": -0.1}]
    # not asked for: null, as before
    plain = completion_body(Endpoint.CHAT, "c", "m", [("x", FinishReason.STOP)], 1, 1)
    assert plain["choices"][0]["logprobs"] is None


def test_logprobs_in_streamed_chunks_one_entry_per_token():
    async def events():
        yield TokenEvent("r", 7, 0, logprobs=_lp(7, -0.5, (7, -0.5)))
        yield TokenEvent("r", 3, 1, logprobs=_lp(3, -1.0, (3, -1.0)))
        yield TokenEvent("r", 4, 2, FinishReason.LENGTH, logprobs=_lp(4, -2.0, (4, -2.0)))

    async def run(endpoint):
        deltas = text_deltas(events(), _Tok(), SamplingParams(logprobs=1))

        async def indexed():
            async for d in deltas:
                yield 0, d
        return [c async for c in stream_chunks(endpoint, "r", "m", 3, indexed(), False)]

    chunks = asyncio.run(run(Endpoint.COMPLETION))
    lps = [c["choices"][0]["logprobs"] for c in chunks]
    assert [lp["tokens"] for lp in lps] == [["<7>"], ["<3>"], ["<4>"]]
    assert [lp["text_offset"] for lp in lps] == [[0], [3], [6]]  # offsets run on per choice
    assert "".join(c["choices"][0]["text"] for c in chunks) == "<7><3><4>"
    for c in chunks:
        StreamChunk.model_validate(c)
    chat = asyncio.run(run(Endpoint.CHAT))
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chat] == [
        "<7>", "<3>", "<4>"]
    for c in chat:
        StreamChunk.model_validate(c)


def test_a_token_with_no_text_yet_still_sends_its_logprobs():
    async def deltas():
        yield 0, StreamDelta("a", [1], None, [LogprobText("a", -0.1)])
        yield 0, StreamDelta("", [2], None, [LogprobText("\ufffd", -0.2)])  # half a character
        yield 0, StreamDelta("é", [3], FinishReason.STOP, [LogprobText("\ufffd", -0.3)])

    async def run():
        return [c async for c in stream_chunks(Endpoint.CHAT, "r", "m", 1, deltas(), False)]
    chunks = asyncio.run(run())
    assert [c["choices"][0]["logprobs"]["content"][0]["logprob"] for c in chunks] == [
        -0.1, -0.2, -0.3]


def _bad(model, body: dict) -> InvalidRequestError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_error(info.value.errors())


@pytest.mark.parametrize(("body", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_p": 1.2}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit to isdigit(), not to int()
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
])
def test_sampling_fields_out_of_range_get_400_naming_them(body, param):
    err = _bad(CompletionRequest, {"prompt": "hi", **body})
    assert err.param == param and err.status_code == 400


def test_sampling_fields_reach_the_sampling_params():
    req = CompletionRequest.model_validate(
        {"prompt": "hi", "presence_penalty": 0.5, "frequency_penalty": -0.25, "min_p": 0.1,
         "min_tokens": 3, "logit_bias": {"42": -100, "7": 2.5}, "logprobs": 0})
    sp = req.sampling_params(16)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.min_p, sp.min_tokens) == (
        0.5, -0.25, 0.1, 3)
    assert sp.logit_bias == ((7, 2.5), (42, -100.0)) and sp.logprobs == 0
    assert CompletionRequest.model_validate({"prompt": "hi"}).sampling_params(16).plain
    with pytest.raises(InvalidRequestError) as info:
        CompletionRequest.model_validate({"prompt": "hi", "min_tokens": 17}).sampling_params(16)
    assert info.value.param == "min_tokens"
    with pytest.raises(InvalidRequestError) as info:
        req.sampling_params(16).__class__(logit_bias=((49152, 1.0),)).check_vocab(49152)
    assert info.value.param == "logit_bias"

    msgs = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest.model_validate({"messages": msgs, "logprobs": True,
                                                 "top_logprobs": 20})
    assert chat.sampling_params(16).logprobs == 20
    assert ChatCompletionRequest.model_validate(
        {"messages": msgs, "logprobs": True}).sampling_params(16).logprobs == 0
    assert ChatCompletionRequest.model_validate(
        {"messages": msgs, "top_logprobs": 0}).sampling_params(16).logprobs is None
    assert "top_logprobs" in _bad(ChatCompletionRequest,
                                  {"messages": msgs, "top_logprobs": 2}).message
    assert _bad(ChatCompletionRequest, {"messages": msgs, "logprobs": True,
                                        "top_logprobs": 21}).param == "top_logprobs"
