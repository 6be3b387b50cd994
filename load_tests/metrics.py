"""Metric arithmetic of the load generator: pure functions over per-request timings.

Definitions follow ``vllm bench serve`` (and DistServe for goodput), so figures compare:

* TTFT: request sent -> first chunk that carries non-empty content.
* ITL: gaps between consecutive content chunks, pooled over all requests of a class.
* TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request; undefined below two tokens.
* E2E: request sent -> last byte of the response.
* Goodput: requests per second that completed *and* met every SLO given.

Percentiles interpolate linearly between order statistics (numpy's default), so
``percentile([1, 2, 3, 4], 50) == 2.5``.

Nothing here does I/O or reads a clock: the load generator records, this module computes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)
# SLO keys a user may give and the per-request value each one bounds (milliseconds)
SLO_METRICS = ("ttft", "tpot", "e2e")


@dataclass(slots=True)
class RequestRecord:
    """What one request did, in seconds relative to the start of its run."""

    request_class: str
    sent_at: float  # when the request left the client
    prompt_tokens: int | None = None  # from the server's usage, else the workload's count
    output_tokens: int = 0  # from the server's usage chunk, else the content chunks counted
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    ok: bool = False
    error: str | None = None
    request_id: str | None = None  # the response's id, to join server-side timings
    server: dict[str, Any] | None = None  # the server's timings of it (GET /debug/requests)

    @property
    def tpot_s(self) -> float | None:
        return tpot(self.e2e_s, self.ttft_s, self.output_tokens)

    @property
    def finished_at(self) -> float | None:
        return None if self.e2e_s is None else self.sent_at + self.e2e_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "class": self.request_class, "sent_at": self.sent_at, "ok": self.ok,
            "error": self.error, "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s, "itl_s": self.itl_s, "request_id": self.request_id,
            "server": self.server,
        }


def tpot(e2e_s: float | None, ttft_s: float | None, output_tokens: int) -> float | None:
    """Mean time per output token after the first; None when it is undefined."""
    if e2e_s is None or ttft_s is None or output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; ``values`` must be non-empty."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """Mean and percentiles of timings given in seconds, reported in milliseconds."""
    if not values_s:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = [v * 1000.0 for v in values_s]
    return {"count": len(ms), "mean": sum(ms) / len(ms),
            **{f"p{q}": percentile(ms, q) for q in PERCENTILES}}


def parse_slos(specs: Iterable[str]) -> dict[str, float]:
    """``["ttft:2000", "tpot:100"]`` (or one string ``"ttft:2000 tpot:100"``) -> ms by metric."""
    slos: dict[str, float] = {}
    for spec in specs:
        for item in spec.replace(",", " ").split():
            name, sep, value = item.partition(":")
            name = name.strip().lower()
            if not sep or name not in SLO_METRICS:
                raise ValueError(f"bad SLO {item!r}: expected NAME:MS with NAME in "
                                 f"{', '.join(SLO_METRICS)}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"bad SLO {item!r}: {value!r} is not a number") from None
            if not ms > 0:
                raise ValueError(f"bad SLO {item!r}: the bound must be positive")
            slos[name] = ms
    return slos


def meets_slos(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    """A request counts toward goodput only if it succeeded and met every SLO.

    A request with one output token has no TPOT; a TPOT bound does not exclude it.
    """
    if not record.ok:
        return False
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2e": record.e2e_s}
    for name, bound_ms in slos.items():
        value = values[name]
        if value is None:
            if name == "tpot" and record.output_tokens < 2:
                continue
            return False
        if value * 1000.0 > bound_ms:
            return False
    return True


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slos: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Latency distributions, throughput, goodput and failures of a set of requests.

    ``duration_s`` is the wall time the rates are computed over (the whole run's, also for
    one class, so class rates add up to the overall rate).
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    slos = dict(slos or {})
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = sum(1 for r in ok if meets_slos(r, slos))
    errors = Counter(r.error or "unknown error" for r in failed)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration_s,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "ttft_ms": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": distribution([g for r in ok for g in r.itl_s]),
        "e2e_ms": distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
        "slos_ms": slos,
        "good_requests": good,
        "goodput": good / duration_s,
        "good_fraction": good / len(records) if records else None,
        "errors": dict(errors.most_common()),
    }


def summarize_by_class(records: Sequence[RequestRecord], duration_s: float,
                       slos: Mapping[str, float] | None = None) -> dict[str, Any]:
    """``{"overall": summary, "classes": {name: summary}}`` in order of first appearance."""
    names = list(dict.fromkeys(r.request_class for r in records))
    return {
        "overall": summarize(records, duration_s, slos),
        "classes": {n: summarize([r for r in records if r.request_class == n], duration_s, slos)
                    for n in names},
    }


# Phases of a request as the server timed them (``RequestTrace.breakdown`` in the ingress),
# in the order they happen.
BREAKDOWN_PHASES = ("prefill_queue_s", "prefill_compute_s", "kv_hop_s", "first_token_s",
                    "decode_queue_s", "decode_s")


def attach_server_timings(records: Sequence[RequestRecord],
                          traces: Iterable[Mapping[str, Any]]) -> int:
    """Give each record the server's trace with its request id; returns how many matched."""
    by_id = {t["id"]: t for t in traces if t.get("id")}
    matched = 0
    for rec in records:
        trace = by_id.get(rec.request_id) if rec.request_id else None
        if trace is not None:
            rec.server = dict(trace)
            matched += 1
    return matched


def breakdown(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Mean and percentiles (ms) of each server-side phase over the successful records that
    carry one, and each phase's share of the mean end-to-end time the client saw."""
    rows = [(r, r.server["breakdown"]) for r in records
            if r.ok and r.server and r.server.get("breakdown")]
    phases = {name: distribution([b[name] for _, b in rows if b.get(name) is not None])
              for name in BREAKDOWN_PHASES}
    e2e = [r.e2e_s for r, _ in rows if r.e2e_s is not None]
    mean_e2e_ms = sum(e2e) / len(e2e) * 1000.0 if e2e else None
    share = {name: (d["mean"] / mean_e2e_ms if mean_e2e_ms and d["mean"] is not None
                    else None) for name, d in phases.items()}
    return {"requests": len(rows), "phases_ms": phases, "client_e2e_ms_mean": mean_e2e_ms,
            "share_of_e2e": share}
