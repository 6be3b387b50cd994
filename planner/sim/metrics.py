"""What a simulated run reports: per-request records (the load generator's metrics) and the run's
summary."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from load_tests.metrics import RequestRecord, meets_slos, summarize, tpot
from planner.hardware import DeviceProfile
from planner.sim.engine import _Busy, _Req
from planner.sim.systems import System


@dataclass(slots=True)
class SimRecord(RequestRecord):
    """A simulated request. With several answers: ``output_tokens`` counts every answer's,
    ``ttft_s`` is the worst answer's first token, ``e2e_s`` the last answer's end and
    ``tpot_s`` the worst answer's TPOT, so the request meets an SLO exactly when every
    answer does."""

    answers: int = 1
    answer_tokens: int = 0  # each answer's output tokens
    worst_tpot_s: float | None = None
    local_prefill: bool = False  # prefilled where it decodes (colocated; split: no KV hop)

    @property
    def tpot_s(self) -> float | None:
        if self.answers == 1:
            return tpot(self.e2e_s, self.ttft_s, self.output_tokens)
        return self.worst_tpot_s


def meets_all_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """``load_tests.metrics.meets_slos``, answer by answer for a request of several."""
    if isinstance(record, SimRecord) and record.answers > 1 and record.answer_tokens < 2:
        slos = {k: v for k, v in slos.items() if k != "tpot"}  # no answer has a TPOT
    return meets_slos(record, slos)


def _record(r: _Req) -> SimRecord:
    a = r.arrival
    firsts = [s.first_token_at for s in r.answers]
    ends = [s.finished_at for s in r.answers]
    assert None not in firsts and None not in ends
    tpots = [tpot(e - r.sent_at, f - r.sent_at, a.output_len)  # type: ignore[operator]
             for f, e in zip(firsts, ends, strict=True)]
    known = [t for t in tpots if t is not None]
    return SimRecord(
        a.request_class, r.sent_at, prompt_tokens=a.input_len,
        output_tokens=a.output_len * a.n, ttft_s=max(firsts) - r.sent_at,  # type: ignore[type-var]
        e2e_s=max(ends) - r.sent_at, ok=True,  # type: ignore[type-var]
        answers=a.n, answer_tokens=a.output_len, worst_tpot_s=max(known) if known else None,
        local_prefill=r.local)


@dataclass(slots=True)
class SimResult:
    system: str
    records: list[SimRecord]
    duration_s: float
    price_per_hour: float
    energy_j: float

    @classmethod
    def build(cls, system: System, done: Iterable[_Req],
              busy: list[tuple[DeviceProfile, _Busy]]) -> SimResult:
        done = sorted(done, key=lambda r: (r.sent_at, r.uid))
        records = [_record(r) for r in done]
        end = max((r.sent_at + (rec.e2e_s or 0.0) for r, rec in zip(done, records, strict=True)),
                  default=0.0)
        duration = max(end, 1e-9)
        energy = 0.0
        for dev, b in busy:
            idle = max(duration - b.prefill_s - b.decode_s, 0.0)
            energy += (b.prefill_s * dev.power_prefill_w + b.decode_s * dev.power_decode_w
                       + idle * dev.power_idle_w)
        return cls(system.describe(), records, duration, system.price_per_hour, energy)

    def summary(self, slos: dict[str, float] | None = None) -> dict[str, Any]:
        s = summarize(self.records, self.duration_s, slos)
        if slos and any(r.answers > 1 for r in self.records):
            good = sum(1 for r in self.records if meets_all_slos(r, slos))
            s.update(good_requests=good, goodput=good / self.duration_s,
                     good_fraction=good / len(self.records) if self.records else None)
        tokens = s["output_tokens"]
        cost = self.price_per_hour * self.duration_s / 3600.0
        s.update({
            "system": self.system,
            "price_per_hour": self.price_per_hour,
            "cost_per_m_output_tokens": cost / tokens * 1e6 if tokens else None,
            "energy_per_request_j": self.energy_j / len(self.records) if self.records else None,
            "energy_j": self.energy_j,
        })
        return s
