"""Side-by-side figures of several load-generator result files, as a Markdown table.

    python -m load_tests.compare --class decode split=dir1 colocated=dir2 ...

Each ``LABEL=PATH`` names a ``results.json`` (or the directory holding it); every run in it
gives one row (one per rate in a sweep).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLUMNS = (
    ("completed", "ok", "{:d}"),
    ("failed", "failed", "{:d}"),
    ("output_throughput", "out tok/s", "{:.1f}"),
    ("ttft_ms.p50", "TTFT p50", "{:,.0f}"),
    ("ttft_ms.p99", "TTFT p99", "{:,.0f}"),
    ("tpot_ms.p50", "TPOT p50", "{:.1f}"),
    ("tpot_ms.p99", "TPOT p99", "{:.1f}"),
    ("itl_ms.p50", "ITL p50", "{:.0f}"),
    ("itl_ms.p99", "ITL p99", "{:,.0f}"),
    ("e2e_ms.p50", "E2E p50", "{:,.0f}"),
    ("goodput", "goodput req/s", "{:.3f}"),
    ("good_fraction", "good", "{:.0%}"),
)


def _get(summary: dict[str, Any], dotted: str) -> Any:
    value: Any = summary
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def load(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    return json.loads((p / "results.json" if p.is_dir() else p).read_text())


def load_labeled(items: list[str], parser: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    """``LABEL=PATH`` arguments -> results by label (a malformed item is a usage error)."""
    loaded = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep:
            parser.error(f"{item!r}: expected LABEL=PATH")
        loaded[label] = load(path)
    return loaded


def rows(label: str, results: dict[str, Any], request_class: str | None) -> list[list[str]]:
    out = []
    for run in results["runs"]:
        summary = run["summary"]
        s = summary["overall"] if request_class is None else summary["classes"].get(
            request_class)
        if s is None:
            continue
        name = label if len(results["runs"]) == 1 or run.get("rate") is None \
            else f"{label} @ {run['rate']:g}/s"
        cells = [name]
        for key, _, fmt in COLUMNS:
            v = _get(s, key)
            cells.append("-" if v is None else fmt.format(v))
        out.append(cells)
    return out


def table(results: dict[str, dict[str, Any]], request_class: str | None) -> str:
    head = ["run", *(title for _, title, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, res in results.items():
        for cells in rows(label, res, request_class):
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="LABEL=results.json or its directory")
    parser.add_argument("--class", dest="request_class", default=None,
                        help="one request class (default: all requests)")
    args = parser.parse_args(argv)
    loaded = load_labeled(args.results, parser)
    print(table(loaded, args.request_class))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
