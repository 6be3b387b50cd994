"""Answers in OpenAI's shape: several choices (n), streamed chunks per choice, and the
merge of several answer streams."""

from __future__ import annotations

import asyncio

import pytest

from app.messages import FinishReason
from app.output import StreamDelta
from app.protocol import CompletionResponse, Endpoint
from deployments.openai_api import completion_body, merge_streams, stream_chunks


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
