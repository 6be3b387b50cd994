"""Goodput of rate sweeps under any SLOs, recomputed from the per-request timings of
load-generator results, and each server's SLO capacity (DistServe's measure: the highest
request rate at which a target share of requests meets every SLO).

    python -m load_tests.goodput --slo ttft:8000 tpot:200 --target 0.9 \\
        split=RESULTS_DIR_A colocated=RESULTS_DIR_B

Several ``--slo`` sets may be given (``--slo "ttft:8000 tpot:200" --slo "ttft:4000 tpot:150"``):
one table per set, so the verdict's sensitivity to the targets is in plain view.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from load_tests.compare import load_labeled
from load_tests.metrics import RequestRecord, meets_slos, parse_slos


def record_of(r: Mapping[str, Any]) -> RequestRecord:
    """A load-generator result's request dict back as a record (for the metric functions)."""
    return RequestRecord(r["class"], r["sent_at"], r.get("prompt_tokens"),
                         r.get("output_tokens") or 0, r.get("ttft_s"), r.get("e2e_s"),
                         list(r.get("itl_s") or []), bool(r.get("ok")), r.get("error"))


def attainment(requests: Sequence[Mapping[str, Any]], slos: Mapping[str, float]) -> float:
    """Share of the requests sent that completed within every SLO (a failure counts as a
    miss)."""
    if not requests:
        return 0.0
    return sum(meets_slos(record_of(r), slos) for r in requests) / len(requests)


def slo_capacity(points: Sequence[tuple[float, float]], target: float) -> float:
    """Highest rate at which attainment is at least ``target``, interpolated linearly
    between the measured rates; 0 when even the lowest rate misses it. ``points`` are
    (rate, attainment) pairs; past the first rate that misses, higher rates are ignored."""
    pts = sorted(points)
    if not pts or pts[0][1] < target:
        return 0.0
    for (r0, a0), (r1, a1) in itertools.pairwise(pts):
        if a1 < target:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    return pts[-1][0]


def sweep_table(results: Mapping[str, Mapping[str, Any]], slos: Mapping[str, float],
                target: float) -> tuple[str, dict[str, float]]:
    """A Markdown table of attainment and goodput per rate and label, and each label's SLO
    capacity."""
    labels = list(results)
    rates = sorted({run["rate"] for res in results.values() for run in res["runs"]
                    if run.get("rate") is not None})
    head = ["rate/s", *(f"{lb} good % / goodput" for lb in labels)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    points: dict[str, list[tuple[float, float]]] = {lb: [] for lb in labels}
    cells: dict[tuple[str, float], str] = {}
    for lb, res in results.items():
        for run in res["runs"]:
            if run.get("rate") is None:
                continue
            att = attainment(run["requests"], slos)
            duration = run["summary"]["overall"]["duration_s"]
            good = att * len(run["requests"]) / duration
            points[lb].append((run["rate"], att))
            cells[(lb, run["rate"])] = f"{att:.0%} / {good:.3f}"
    for rate in rates:
        lines.append("| " + " | ".join([f"{rate:g}", *(cells.get((lb, rate), "-")
                                                      for lb in labels)]) + " |")
    capacity = {lb: slo_capacity(points[lb], target) for lb in labels}
    lines.append("| capacity at " + f"{target:.0%} | "
                 + " | ".join(f"{capacity[lb]:.3f} req/s" for lb in labels) + " |")
    return "\n".join(lines), capacity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="LABEL=results.json or its directory")
    parser.add_argument("--slo", action="append", required=True, metavar="SET",
                        help='an SLO set like "ttft:8000 tpot:200" (repeatable)')
    parser.add_argument("--target", type=float, default=0.9,
                        help="attainment that defines capacity (default %(default)s)")
    args = parser.parse_args(argv)
    loaded = load_labeled(args.results, parser)
    for spec in args.slo:
        slos = parse_slos([spec])
        text, capacity = sweep_table(loaded, slos, args.target)
        print(f"SLOs {spec}:")
        print(text)
        labels = list(capacity)
        if len(labels) == 2 and capacity[labels[1]] > 0:
            print(f"capacity ratio {labels[0]} / {labels[1]}: "
                  f"{capacity[labels[0]] / capacity[labels[1]]:.2f}")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
