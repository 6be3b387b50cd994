"""Per-request server-side timings: what ``GET /debug/requests``, the handle's ``trace`` and
``recent_requests``, and the load generator's ``--server-timings`` report; where a KV object
lies (``kv_object_locations``)."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from app.messages import StreamStart


@dataclass(slots=True)
class RequestTrace:
    """Server-side timings of one request (seconds).

    ``breakdown`` splits the request's life into phases: ``prefill_queue_s`` (ingress hand-off,
    routing and waiting for a prefill batch), ``prefill_compute_s`` (the batch's forward pass),
    ``kv_hop_s`` (prefill returned -> the decode replica holds the package),
    ``first_token_s`` (the rest of the time to the first token: stream start, detokenizing,
    the hops back to the ingress), ``decode_queue_s`` (waiting to join the decode batch,
    which the client sees as a longer gap after the first token) and ``decode_s`` (first to
    last token). Cross-process differences use wall clocks (``time.time()``), so on a
    multi-node cluster they are as good as its clock sync.
    """

    received: float = field(default_factory=time.perf_counter)
    received_at: float = field(default_factory=time.time)
    stream_start: StreamStart | None = None
    first_token: float | None = None
    last_token: float | None = None
    decode_queue_s: float | None = None
    output_tokens: int = 0
    attempts: int = 0  # streams started: 1, plus one per retry
    kv_locations: list[str] | None = None
    kv_object_size: int | None = None
    # prompt tokens the prefix cache supplied to the first stream's prefill: what usage
    # reports (a retry re-prefills a longer prompt, mostly from the cache)
    cached_tokens: int | None = None
    # waiting for room in the ingress's KV budget before prefill (decode taking packages
    # more slowly than prefill makes them: deployments.kv_budget), over all attempts
    kv_budget_wait_s: float = 0.0
    # one entry per retry: when (s after arrival), the error, tokens delivered before it,
    # and how long the ingress then waited for the phases to answer again (a phase that
    # lost every replica: until a replacement has started)
    retries: list[dict[str, Any]] = field(default_factory=list)
    # set when a short prompt was prefilled on the decode replica because the prefill
    # phase was backed up (``local_prefill_when_busy``): the backlog it saw, in tokens
    prefill_busy_backlog: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.received

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None under two tokens."""
        if self.output_tokens < 2 or self.first_token is None or self.last_token is None:
            return None
        return (self.last_token - self.first_token) / (self.output_tokens - 1)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.received

    def token(self, n: int) -> None:
        """``n`` output tokens reached the ingress now."""
        t = time.perf_counter()
        if self.first_token is None:
            self.first_token = t
        self.last_token = t
        self.output_tokens += n

    def breakdown(self) -> dict[str, float | None] | None:
        s = self.stream_start
        if s is None or self.first_token is None or not s.prefill_done_at:
            return None
        queue = max(0.0, s.prefill_done_at - s.prefill_s - self.received_at)
        ttft = self.first_token - self.received
        decode = None if self.last_token is None else self.last_token - self.first_token
        return {
            "prefill_queue_s": queue,
            "prefill_compute_s": s.prefill_s,
            "kv_hop_s": s.kv_hop_s,
            "first_token_s": max(0.0, ttft - queue - s.prefill_s - s.kv_hop_s),
            "decode_queue_s": self.decode_queue_s,
            "decode_s": decode,
        }

    def as_dict(self) -> dict[str, Any]:
        s = self.stream_start
        out: dict[str, Any] = {
            "ttft_s": self.ttft_s,
            "e2e_s": None if self.last_token is None else self.last_token - self.received,
            "output_tokens": self.output_tokens,
            "attempts": self.attempts,
            "kv_budget_wait_s": self.kv_budget_wait_s,
            "retries": self.retries,
            "breakdown": self.breakdown(),
        }
        if self.prefill_busy_backlog is not None:
            out["prefill_busy_backlog_tokens"] = self.prefill_busy_backlog
        if s is not None:
            out.update(decode_node=s.node_id, kv_bytes=s.kv_bytes, kv_hop_s=s.kv_hop_s,
                       kv_fetch_s=s.fetch_s, prefill_compute_s=s.prefill_s,
                       prefill_path="local" if s.local_prefill else "remote",
                       decode_replica=s.replica_id, cached_prompt_tokens=s.cached_tokens)
        if self.kv_locations is not None:
            out.update(kv_locations=self.kv_locations, kv_object_size=self.kv_object_size)
        return out


class TraceHistory:
    """The traces of the last ``size`` finished requests (``size`` 0: none kept)."""

    def __init__(self, size: int) -> None:
        self.enabled = size > 0
        self._items: collections.deque[dict[str, Any]] = collections.deque(maxlen=size or 1)

    def add(self, request_id: str, prompt_tokens: int, trace: RequestTrace) -> None:
        if self.enabled:
            self._items.append({"id": request_id, "prompt_tokens": prompt_tokens,
                                **trace.as_dict()})

    def last(self, limit: int) -> list[dict[str, Any]]:
        """Newest last."""
        if not self.enabled or limit <= 0:
            return []
        return list(self._items)[-limit:]


def kv_object_locations(ref: ray.ObjectRef) -> tuple[list[str], int | None]:
    """The nodes that hold a KV object and its size (diagnostics, never its bytes)."""
    loc = ray.experimental.get_object_locations([ref])[ref]
    return list(loc.get("node_ids", [])), loc.get("object_size")
