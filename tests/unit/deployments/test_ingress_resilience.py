"""The ingress's failure policy, on fake phase streams (no Ray cluster): resume after a lost
replica with no missing or duplicated token, a bounded retry budget, a request timeout, and
no retry for errors that a retry cannot fix."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from app.decode import TokenEvent
from app.errors import QueueFullError, RequestTimeoutError
from app.output import GenerationFailed
from app.sampling import SamplingParams
from app.sequence import PrefillRequest
from deployments.args import AppArgs
from deployments.ingress import Ingress, is_retryable

TOKENS = list(range(100, 112))

# the Serve ingress wrapper's __del__ is a coroutine; instances made without __init__ warn
pytestmark = pytest.mark.filterwarnings("ignore:coroutine .*__del__.* was never awaited")


def make_ingress(fake_events, **args) -> object:
    cls = Ingress.func_or_class
    ing = object.__new__(cls)  # no __init__: no tokenizer, no handles, no Ray
    ing.args = AppArgs.model_validate({"retry_backoff_s": 0.01, **args})
    ing.retries = 0
    ing._token_events = fake_events
    return ing


def request(max_tokens: int = len(TOKENS)) -> PrefillRequest:
    return PrefillRequest("req", (1, 2, 3), SamplingParams(max_tokens=max_tokens,
                                                           temperature=0.0))


async def collect(ing, preq) -> list[TokenEvent]:
    return [ev async for ev in ing._resilient_events(preq, None)]


def test_resume_after_a_lost_decode_replica_continues_the_stream():
    calls: list[PrefillRequest] = []

    async def events(preq, trace):
        calls.append(preq)
        start = preq.output_offset
        for i, tok in enumerate(TOKENS[start:], start):
            if len(calls) == 1 and i == 5:
                raise ray.exceptions.ActorDiedError()
            last = i == len(TOKENS) - 1
            yield TokenEvent(preq.request_id, tok, i, "length" if last else None)

    ing = make_ingress(events)
    out = asyncio.run(collect(ing, request()))
    assert [e.token_id for e in out] == TOKENS  # none missing, none twice
    assert [e.index for e in out] == list(range(len(TOKENS)))
    retry = calls[1]
    assert retry.prompt_token_ids == (1, 2, 3, *TOKENS[:5])  # prompt + what was sent
    assert retry.output_offset == 5
    assert retry.sampling.max_tokens == len(TOKENS) - 5
    assert ing.retries == 1


def test_lost_kv_object_before_any_token_reruns_prefill():
    calls = 0

    async def events(preq, trace):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ray.exceptions.OwnerDiedError("0" * 56, None, "")
        for i, tok in enumerate(TOKENS):
            yield TokenEvent(preq.request_id, tok, i, "length" if i == len(TOKENS) - 1 else None)

    out = asyncio.run(collect(make_ingress(events), request()))
    assert [e.token_id for e in out] == TOKENS and calls == 2


def test_retry_budget_runs_out_with_a_clean_error_in_bounded_time():
    calls = 0

    async def events(preq, trace):
        nonlocal calls
        calls += 1
        yield TokenEvent(preq.request_id, TOKENS[preq.output_offset], preq.output_offset)
        raise ray.exceptions.ActorDiedError()

    ing = make_ingress(events, max_retries=2)
    t = time.perf_counter()
    with pytest.raises(GenerationFailed, match="after 2 retries"):
        asyncio.run(collect(ing, request()))
    assert calls == 3 and time.perf_counter() - t < 2.0


def test_errors_a_retry_cannot_fix_are_not_retried():
    calls = 0

    async def events(preq, trace):
        nonlocal calls
        calls += 1
        raise QueueFullError("full")
        yield  # pragma: no cover

    with pytest.raises(QueueFullError):
        asyncio.run(collect(make_ingress(events), request()))
    assert calls == 1
    assert not is_retryable(QueueFullError("x")) and not is_retryable(ValueError())
    assert is_retryable(ray.exceptions.ActorDiedError())
    assert is_retryable(ray.exceptions.ObjectLostError("0" * 56, None, ""))


def test_request_timeout_ends_a_stuck_stream():
    closed = asyncio.Event()

    async def events(preq, trace):
        try:
            yield TokenEvent(preq.request_id, TOKENS[0], 0)
            await asyncio.sleep(3600)
        finally:
            closed.set()

    async def run():
        ing = make_ingress(events, request_timeout_s=0.3)
        t = time.perf_counter()
        with pytest.raises(RequestTimeoutError):
            await collect(ing, request())
        return time.perf_counter() - t

    elapsed = asyncio.run(run())
    assert 0.25 <= elapsed < 2.0


def test_request_trace_breakdown_splits_the_request_life():
    """The phases come from the stream start (prefill end on the wall clock, compute, hop)
    and the ingress's own marks; they add up to the time to first token."""
    from deployments.ingress import RequestTrace
    from deployments.replica import StreamStart

    t = RequestTrace(received=100.0, received_at=5000.0)
    assert t.breakdown() is None  # nothing started yet
    # prefill batch started at 5000.5 (queued 0.5 s), computed 1.0 s, done at 5001.5
    t.stream_start = StreamStart("node", 10, kv_hop_s=0.05, fetch_s=0.04, prefill_s=1.0,
                                 prefill_done_at=5001.5)
    t.first_token, t.last_token, t.decode_queue_s = 101.6, 103.6, 0.2
    b = t.breakdown()
    assert b == pytest.approx({"prefill_queue_s": 0.5, "prefill_compute_s": 1.0,
                               "kv_hop_s": 0.05, "first_token_s": 0.05,
                               "decode_queue_s": 0.2, "decode_s": 2.0})
    assert sum(b[k] for k in ("prefill_queue_s", "prefill_compute_s", "kv_hop_s",
                              "first_token_s")) == pytest.approx(t.first_token - t.received)
    assert t.as_dict()["breakdown"] == b
