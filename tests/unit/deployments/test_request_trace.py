"""Per-request server-side timings: the breakdown of a request's life and the history."""

from __future__ import annotations

import pytest

from app.messages import StreamStart
from deployments.request_trace import RequestTrace, TraceHistory


def test_request_trace_breakdown_splits_the_request_life():
    """The phases come from the stream start (prefill end on the wall clock, compute, hop)
    and the ingress's own marks; they add up to the time to first token."""
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


def test_tokens_mark_first_and_last_and_give_tpot():
    t = RequestTrace()
    assert t.ttft_s is None and t.tpot_s is None
    t.token(1)
    assert t.ttft_s is not None and t.ttft_s >= 0 and t.tpot_s is None  # one token: no TPOT
    t.token(0)  # a delta with text but no new token (the end of a stream)
    t.token(2)
    assert t.output_tokens == 3
    assert t.tpot_s == pytest.approx((t.last_token - t.first_token) / 2)


def test_history_keeps_the_last_requests_newest_last_or_none():
    h = TraceHistory(2)
    for i in range(3):
        h.add(f"r{i}", 10 + i, RequestTrace())
    assert [e["id"] for e in h.last(100)] == ["r1", "r2"]
    assert [e["id"] for e in h.last(1)] == ["r2"] and h.last(0) == []
    assert h.last(1)[0]["prompt_tokens"] == 12
    off = TraceHistory(0)
    off.add("r", 1, RequestTrace())
    assert not off.enabled and off.last(10) == []
