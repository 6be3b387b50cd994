"""Ratios to vLLM over repeated rounds of ``load_tests/peer_bench.sh`` (one results folder a
round, the servers' order rotated between rounds): for each workload and figure, each
server's median over the rounds and its ratio to vLLM's in the same round, as the median
with the min-max of the rounds' ratios.

    python load_tests/peer_rounds.py ROUND_DIR [ROUND_DIR ...] [--servers vllm split colocated]
        [--figure "W-short:ITL p99 ms" ...] [--baseline vllm-matched]

A server may be named ``NAME@DTYPE`` to take it from one dtype's rounds of ``make
bench-peers`` only, so that servers at different dtypes compare round by round: on an
AVX2-only CPU, ``OUT/*/round-* --servers split@bfloat16 vllm@float32 --baseline
vllm@float32`` (this app at its fastest dtype there against vLLM at its own).

``--figure WORKLOAD:FIGURE`` (any of ``peer_table``'s figures) adds a row to the default ones.

Standard library only, as ``peer_table.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from peer_table import FIGURES, SERVERS, WORKLOADS

# the figures read per workload (the rest of peer_table's are printed too where present)
KEY_FIGURES = {"W-single": ("TPOT p50 ms", "out tok/s"), "W-short": ("out tok/s", "TPOT p50 ms"),
               "W-long": ("prompt tok/s", "TTFT p50 ms")}


def with_figures(extra: list[str]) -> dict:
    """KEY_FIGURES plus ``WORKLOAD:FIGURE`` entries (a figure label of ``peer_table``)."""
    figures = {w: tuple(labels) for w, labels in KEY_FIGURES.items()}
    labels = {label for label, _ in FIGURES}
    for entry in extra:
        workload, _, label = entry.partition(":")
        if workload not in WORKLOADS or label not in labels:
            raise ValueError(f"unknown figure {entry!r}: WORKLOAD:FIGURE of {WORKLOADS} "
                             f"and {sorted(labels)}")
        if label not in figures.get(workload, ()):
            figures[workload] = (*figures.get(workload, ()), label)
    return figures


def source(server: str) -> tuple[str, str | None]:
    """A ``--servers`` entry: ``NAME`` (its ``NAME_<workload>.json`` in every round folder)
    or ``NAME@DTYPE`` (only in round folders under a folder named DTYPE, as ``make
    bench-peers`` lays out each dtype's rounds: the app at bf16 against vLLM at float32)."""
    name, _, parent = server.partition("@")
    return name, parent or None


def load(rounds: list[Path], servers: list[str], figures: dict | None = None) -> dict:
    """{(workload, figure): {server: {round name: value}}} for the rounds that have it;
    ``figures`` ({workload: labels}, KEY_FIGURES by default) chooses the rows. Rounds pair
    by their folder's name (``round-N``), across dtypes too; ValueError where a server
    without ``@DTYPE`` has two folders of one name."""
    figures = KEY_FIGURES if figures is None else figures
    table: dict = {}
    for folder in rounds:
        for workload in WORKLOADS:
            for label, read in FIGURES:
                if label not in figures.get(workload, ()):
                    continue
                for server in servers:
                    name, parent = source(server)
                    path = folder / f"{name}_{workload}.json"
                    if (parent is not None and folder.parent.name != parent) or (
                            not path.is_file()):
                        continue
                    cell = table.setdefault((workload, label), {}).setdefault(server, {})
                    if folder.name in cell:
                        raise ValueError(f"{server}: two rounds named {folder.name} (name "
                                         f"the dtype: {name}@<folder>)")
                    cell[folder.name] = read(json.loads(path.read_text()))
    return table


def render(table: dict, servers: list[str], baseline: str = "vllm") -> str:
    """The table; ratios are each server's value over ``baseline``'s in the same round."""
    head = ["workload", "figure"] + [f"{s} (median)" for s in servers]
    head += [f"{s} / {baseline} (median, min-max)" for s in servers if s != baseline]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (workload, label), cell in table.items():
        row = [workload, label]
        for server in servers:
            values = [v for v in cell.get(server, {}).values() if v is not None]
            row.append(f"{statistics.median(values):,.1f}" if values else "-")
        for server in servers:
            if server == baseline:
                continue
            ratios = [v / cell[baseline][r] for r, v in cell.get(server, {}).items()
                      if v is not None and cell.get(baseline, {}).get(r)]
            row.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, "
                       f"{len(ratios)} rounds)" if ratios else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rounds", type=Path, nargs="+")
    ap.add_argument("--servers", nargs="+", default=SERVERS)
    ap.add_argument("--figure", action="append", default=[],
                    help="WORKLOAD:FIGURE to add to the default rows (repeatable)")
    ap.add_argument("--baseline", default="vllm",
                    help="the server the ratios are to (e.g. vllm-matched), one of --servers")
    args = ap.parse_args(argv)
    if args.baseline not in args.servers:
        ap.error(f"--baseline {args.baseline} is not one of --servers")
    try:
        table = load(args.rounds, args.servers, with_figures(args.figure))
    except ValueError as exc:
        ap.error(str(exc))
    print(render(table, args.servers, args.baseline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
