"""Placement search: the split fleet (hardware per phase, P:D) and the colocated fleet with the
highest goodput per dollar, side by side.

Goodput of a configuration is the highest request rate it sustains while at least
``attainment`` of the requests meet every SLO (DistServe's definition), found by bisection
over simulated runs of the workload. Split candidates are first ranked by a per-phase bound
(P x the rate one prefill replica holds under the TTFT target, D x the rate one decode replica
holds under the TPOT target: DistServe's phase-by-phase search) and the best few are then
simulated whole. Comparing at equal cost scales each configuration's goodput by
``budget / price`` (whole copies of the unit).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from planner.hardware import DeviceProfile, PassCost
from planner.sim import (
    ColocatedSystem,
    EngineLimits,
    SplitSystem,
    System,
    Workload,
    simulate,
)


def attainment(system: System, workload: Workload, slos: dict[str, float]) -> dict[str, Any]:
    return simulate(system, workload.arrivals()).summary(slos)


def max_goodput_rate(system: System, workload: Workload, slos: dict[str, float], *,
                     target: float = 0.9, hi: float | None = None, iterations: int = 10,
                     min_span_s: float = 60.0,
                     max_requests: int = 20000) -> tuple[float, dict[str, Any] | None]:
    """Highest rate at which ``target`` of requests meet the SLOs (0 if none does).

    Each trial's arrivals span at least ``min_span_s`` seconds: a backlog that a short run
    would drain unnoticed (decode waiting hides in TPOT, spread over every output token) has
    to grow for a minute and so breaks the SLO.
    """
    def ok(rate: float) -> tuple[bool, dict[str, Any]]:
        n = min(max(workload.num_requests, int(rate * min_span_s)), max_requests)
        s = attainment(system, replace(workload.with_rate(rate), num_requests=n), slos)
        return (s["good_fraction"] or 0.0) >= target, s

    lo, best = 0.0, None
    hi = hi or 1.0
    while True:  # grow until it fails
        good, s = ok(hi)
        if not good:
            break
        lo, best, hi = hi, s, hi * 2
        if hi > 1e5:
            return lo, best
    for _ in range(iterations):
        mid = (lo + hi) / 2 if lo else hi / 2
        good, s = ok(mid)
        if good:
            lo, best = mid, s
        else:
            hi = mid
        if lo and (hi - lo) / lo < 0.03:
            break
    return lo, best


@dataclass(frozen=True, slots=True)
class Candidate:
    system: System
    goodput_rps: float  # highest rate meeting the SLO attainment
    summary: dict[str, Any] | None

    @property
    def price_per_hour(self) -> float:
        return self.system.price_per_hour

    @property
    def goodput_per_dollar(self) -> float:
        """Good requests per dollar (rate x 3600 / price per hour)."""
        return self.goodput_rps * 3600.0 / self.price_per_hour

    def at_budget(self, budget_per_hour: float) -> dict[str, Any]:
        copies = budget_per_hour / self.price_per_hour
        s = self.summary or {}
        return {
            "system": self.system.describe(),
            "copies": copies,
            "goodput_rps": self.goodput_rps * copies,
            "goodput_per_dollar": self.goodput_per_dollar,
            "cost_per_m_output_tokens": s.get("cost_per_m_output_tokens"),
            "energy_per_request_j": s.get("energy_per_request_j"),
            "ttft_p90_ms": (s.get("ttft_ms") or {}).get("p90"),
            "tpot_p90_ms": (s.get("tpot_ms") or {}).get("p90"),
        }


def search(devices: Sequence[DeviceProfile], workload: Workload, slos: dict[str, float], *,
           limits: EngineLimits | None = None, max_per_phase: int = 4, top_k: int = 3,
           target: float = 0.9, colocated_policies: Sequence[str] = ("mixed", "chunked"),
           chunk_tokens: int = 512, min_span_s: float = 60.0,
           log: Callable[[str], None] = lambda _: None) -> dict[str, list[Candidate]]:
    """Best split and colocated candidates (each list sorted by goodput per dollar).
    ``colocated_policies``: ``ColocatedSystem.policy`` of the colocated candidates ("mixed":
    this app; "interleave": this app with ``mixed_batch: false``; "chunked": vLLM-style,
    ``chunk_tokens`` per step)."""
    limits = limits or EngineLimits()
    opts = {"target": target, "min_span_s": min_span_s}
    prefill_rate, decode_rate = _per_replica_rates(devices, workload, slos, limits, opts, log)
    bounds = _split_bounds(devices, prefill_rate, decode_rate, max_per_phase, limits)
    split = _candidates([sysm for _, sysm in bounds[:top_k]], workload, slos, opts, log)
    colocated = _candidates([ColocatedSystem(dev, 1, limits, policy, chunk_tokens)
                             for dev in devices for policy in colocated_policies],
                            workload, slos, opts, log)
    split.sort(key=lambda c: -c.goodput_per_dollar)
    colocated.sort(key=lambda c: -c.goodput_per_dollar)
    return {"split": split, "colocated": colocated}


def _per_replica_rates(devices: Sequence[DeviceProfile], workload: Workload,
                       slos: dict[str, float], limits: EngineLimits, opts: dict[str, Any],
                       log: Callable[[str], None]) -> tuple[dict[str, float], dict[str, float]]:
    """Per-phase capacity of one replica of each kind, the other phase given ample room: the
    prefill rate under the TTFT target, the decode rate under the TPOT target."""
    ttft_only = {k: v for k, v in slos.items() if k == "ttft"}
    tpot_only = {k: v for k, v in slos.items() if k == "tpot"}
    # each phase on its own: no prompt is prefilled on a decode replica
    limits = replace(limits, local_prefill_threshold=0, local_prefill_when_busy=0)
    prefill_rate, decode_rate = {}, {}
    best_decode = min(devices, key=lambda d: d.decode_s(16, 1024))
    for dev in devices:
        prefill_rate[dev.name], _ = max_goodput_rate(
            SplitSystem(dev, best_decode, 1, 8, limits), workload, ttft_only, **opts)
        # prefill at no cost: the decode replica sees every prompt as it arrives, however
        # many prefill replicas that would take (with chunked passes, eight may not do)
        free_prefill = replace(dev, name=f"{dev.name}-free-prefill", prefill=PassCost())
        decode_rate[dev.name], _ = max_goodput_rate(
            SplitSystem(free_prefill, dev, 1, 1, limits), workload, tpot_only, **opts)
        log(f"{dev.name}: prefill {prefill_rate[dev.name]:.2f} req/s, "
            f"decode {decode_rate[dev.name]:.2f} req/s per replica")
    return prefill_rate, decode_rate


def _split_bounds(devices: Sequence[DeviceProfile], prefill_rate: dict[str, float],
                  decode_rate: dict[str, float], max_per_phase: int,
                  limits: EngineLimits) -> list[tuple[float, SplitSystem]]:
    """Every split fleet with its per-phase bound on goodput per dollar, best first."""
    bounds = []
    for pdev in devices:
        for ddev in devices:
            for p in range(1, max_per_phase + 1):
                for d in range(1, max_per_phase + 1):
                    rate = min(p * prefill_rate[pdev.name], d * decode_rate[ddev.name])
                    price = p * pdev.price_per_hour + d * ddev.price_per_hour
                    bounds.append((rate / price, SplitSystem(pdev, ddev, p, d, limits)))
    bounds.sort(key=lambda b: -b[0])
    return bounds


def _candidates(systems: Sequence[System], workload: Workload, slos: dict[str, float],
                opts: dict[str, Any], log: Callable[[str], None]) -> list[Candidate]:
    """Each system simulated whole: its goodput."""
    out = []
    for sysm in systems:
        rate, s = max_goodput_rate(sysm, workload, slos, **opts)
        out.append(Candidate(sysm, rate, s))
        log(f"{sysm.describe()}: {rate:.2f} req/s")
    return out


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.{digits}f}"


def table(result: dict[str, list[Candidate]], budget_per_hour: float) -> str:
    """Markdown: every candidate at the same hourly budget."""
    lines = [f"At ${budget_per_hour:,.2f}/h:", "",
             "| system | $/h (unit) | goodput req/s | good req per $ | $/M out tok | "
             "J/request | TTFT p90 ms | TPOT p90 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for kind in ("split", "colocated"):
        for c in result[kind]:
            b = c.at_budget(budget_per_hour)
            lines.append(
                f"| {b['system']} | {c.price_per_hour:.2f} | {_fmt(b['goodput_rps'], 2)} | "
                f"{_fmt(b['goodput_per_dollar'], 0)} | "
                f"{_fmt(b['cost_per_m_output_tokens'], 3)} | "
                f"{_fmt(b['energy_per_request_j'], 0)} | {_fmt(b['ttft_p90_ms'], 0)} | "
                f"{_fmt(b['tpot_p90_ms'], 1)} |")
    return "\n".join(lines)


def plot(result: dict[str, list[Candidate]], path: str, title: str = "") -> None:
    """Bars: good requests per dollar of every candidate, split and colocated."""
    plot_rows([(c.system.describe(), c.goodput_per_dollar, kind)
               for kind in ("split", "colocated") for c in result[kind]], path, title)


def plot_rows(rows: list[tuple[str, float, str]], path: str, title: str = "") -> None:
    """``rows``: (system, good requests per dollar, "split" | "colocated")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r[1])
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.2))
    colors = {"split": "tab:blue", "colocated": "tab:orange"}
    ax.barh([r[0] for r in rows], [r[1] for r in rows], color=[colors[r[2]] for r in rows])
    ax.set_xlabel("requests meeting the SLOs per dollar (goodput x 3600 / $ per hour)")
    ax.set_title(title or "goodput per dollar", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
