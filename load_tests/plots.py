"""PNG plots of load-generator results: latency CDFs per class, goodput vs request rate.

Also a small CLI to overlay result files (e.g. split vs colocated)::

    python -m load_tests.plots --out cmp.png split=results/a/results.json colo=results/b/...
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from load_tests.compare import load_labeled

LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E latency"))


def _values(requests: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    out: list[float] = []
    for r in requests:
        if not r.get("ok"):
            continue
        v = r.get(key)
        if isinstance(v, list):
            out.extend(x * 1000 for x in v)
        elif v is not None:
            out.append(v * 1000)
    return sorted(out)


def plot_latency_cdfs(series: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path,
                      title: str = "") -> Path:
    """One CDF per series (a class, or a server) for TTFT, TPOT, ITL and E2E.

    ``series`` maps a label to request dicts (``RequestRecord.as_dict()``).
    """
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, label) in zip(axes.flat, LATENCIES, strict=True):
        drawn = False
        for name, requests in series.items():
            vals = _values(requests, key)
            if not vals:
                continue
            ys = [0.0] + [(i + 1) / len(vals) for i in range(len(vals))]
            ax.step([vals[0], *vals], ys, where="post", label=f"{name} (n={len(vals)})")
            drawn = True
        ax.set_title(label)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itl_s" else "fraction of gaps")
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.set_xscale("log")
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_goodput_vs_rate(sweeps: Mapping[str, Sequence[tuple[float, Mapping[str, Any]]]],
                         path: str | Path, slos: Mapping[str, float] | None = None) -> Path:
    """Goodput and completed-request throughput against offered rate, one line per label.

    ``sweeps`` maps a label (a server) to ``(rate, summary)`` pairs, ``summary`` being the
    ``overall`` part of a run's results.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in sweeps.items():
        pts = sorted(points, key=lambda p: p[0])
        rates = [p[0] for p in pts]
        ax.plot(rates, [p[1]["goodput"] for p in pts], marker="o", label=f"{label} goodput")
        ax.plot(rates, [p[1]["request_throughput"] for p in pts], marker=".", linestyle=":",
                label=f"{label} completed")
    top = max((r for pts in sweeps.values() for r, _ in pts), default=1.0)
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, linestyle="--", label="offered")
    slo_text = ", ".join(f"{k} ≤ {v:g} ms" for k, v in (slos or {}).items())
    ax.set_title("Goodput vs request rate" + (f" ({slo_text})" if slo_text else ""))
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("req/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Overlay load-generator results.")
    parser.add_argument("results", nargs="+", help="LABEL=results.json or its directory")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--class", dest="request_class", default=None,
                        help="compare this class's latency CDFs (default: all requests)")
    parser.add_argument("--goodput", action="store_true",
                        help="plot goodput vs rate instead of latency CDFs")
    args = parser.parse_args(argv)
    loaded = load_labeled(args.results, parser)
    if args.goodput:
        sweeps = {label: [(run["rate"], run["summary"]["overall"]) for run in res["runs"]]
                  for label, res in loaded.items()}
        slos = next(iter(loaded.values()))["config"].get("slos_ms")
        plot_goodput_vs_rate(sweeps, args.out, slos)
    else:
        series = {}
        for label, res in loaded.items():
            for run in res["runs"]:
                reqs = [r for r in run.get("requests", [])
                        if args.request_class is None or r["class"] == args.request_class]
                suffix = f" @ {run['rate']:g}/s" if run.get("rate") and len(res["runs"]) > 1 \
                    else ""
                series[f"{label}{suffix}"] = reqs
        plot_latency_cdfs(series, args.out, args.request_class or "all requests")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
