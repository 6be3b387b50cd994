"""Side-by-side table of ``vllm bench serve`` results (issue 13, ``load_tests/peer_bench.sh``).

Reads the result files that ``vllm bench serve --save-result`` wrote into one folder, named
``<server>_<workload>.json`` (``vllm_W-short.json``, ``split_W-short.json``,
``colocated_W-mixed-long.json``, ...), and prints a Markdown table: one row per workload and
figure, one column per server, and each other server's ratio to the first (vLLM).

    python load_tests/peer_table.py RESULTS_DIR [--servers vllm split colocated]

Standard library only, so any Python 3 runs it (no project venv, no vLLM needed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

WORKLOADS = ["W-short", "W-single", "W-long", "W-mixed-streams", "W-chat", "W-mixed-long"]
SERVERS = ["vllm", "split", "colocated"]
SERVER_NAMES = {"vllm": "vLLM-CPU", "split": "split (`make run`)", "colocated": "colocated"}

# (label, how to read it from a result)
FIGURES = [
    ("out tok/s", lambda r: r.get("output_throughput")),
    ("prompt tok/s", lambda r: _per_s(r, "total_input_tokens")),
    ("TPOT p50 ms", lambda r: _pct(r, "tpot", "50")),
    ("ITL p99 ms", lambda r: _pct(r, "itl", "99")),
    ("TTFT p50 ms", lambda r: _pct(r, "ttft", "50")),
    ("TTFT p90 ms", lambda r: _pct(r, "ttft", "90")),
]


def _pct(result: dict, metric: str, p: str) -> float | None:
    value = result.get(f"p{p}_{metric}_ms")
    if value is None and p == "50":
        value = result.get(f"median_{metric}_ms")
    return value


def _per_s(result: dict, key: str) -> float | None:
    count, duration = result.get(key), result.get("duration")
    return count / duration if count is not None and duration else None


def load(folder: Path) -> dict[tuple[str, str], dict]:
    """{(server, workload): result} for every ``<server>_<workload>.json`` in ``folder``."""
    results = {}
    for path in sorted(folder.glob("*_W-*.json")):
        server, _, workload = path.stem.partition("_")
        try:
            results[(server, workload)] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"skipping {path}: {exc}", file=sys.stderr)
    return results


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if abs(value) < 100 else f"{value:,.0f}"


def table(results: dict[tuple[str, str], dict], servers: list[str]) -> str:
    base, others = servers[0], servers[1:]
    head = [SERVER_NAMES.get(s, s) for s in servers]
    head += [f"{s} / {base}" for s in others]
    lines = ["| workload | figure | " + " | ".join(head) + " |",
             "|---|---|" + "---|" * len(head)]
    workloads = [w for w in WORKLOADS if any((s, w) in results for s in servers)]
    workloads += sorted({w for _, w in results} - set(WORKLOADS))
    for workload in workloads:
        done = []
        for server in servers:
            result = results.get((server, workload))
            if result is not None:
                n, total = result.get("completed"), result.get("num_prompts")
                failed = f" ({total - n} failed)" if n is not None and total and n < total else ""
                done.append(f"{n}/{total}{failed}" if n is not None else "?")
            else:
                done.append("-")
        lines.append(f"| {workload} | completed | " + " | ".join(done)
                     + " |" + " |" * len(others))
        for label, read in FIGURES:
            values = [read(results[(s, workload)]) if (s, workload) in results else None
                      for s in servers]
            cells = [_fmt(v) for v in values]
            for value in values[1:]:
                if value and values[0]:
                    ratio = value / values[0]
                    cells.append(f"{ratio:.2f}x")
                else:
                    cells.append("-")
            lines.append(f"| {workload} | {label} | " + " | ".join(cells) + " |")
    if others:
        name = SERVER_NAMES.get(base, base)
        lines += ["", f"Ratios: each server's figure / {name}'s "
                  "(above 1 is better for tok/s, worse for ms)."]
    return "\n".join(lines)


def floor_lines(folder: Path, results: dict[tuple[str, str], dict],
                servers: list[str]) -> list[str]:
    """The decode step's floor and the engine's own step (``decode_bench.json`` of the same
    run) beside each server's TPOT at concurrency 1 (W-single) and tok/s at 8 (W-short)."""
    path = folder / "decode_bench.json"
    if not path.is_file():
        return []
    bench = next(iter(json.loads(path.read_text()).values()))
    floor, step1 = bench["floor_ms"], bench["step1_ms"]
    lines = ["", f"Decode floor (one GEMV over {bench['weight_mb']:.0f} MB, one thread): "
             f"{floor:.1f} ms; engine step {step1:.1f} ms at batch 1, "
             f"{bench['step8_ms']:.1f} ms at batch 8 ({bench['step8_over_step1']:.2f}x).", "",
             "| server | W-single TPOT p50 / floor | / engine step | "
             "W-short out tok/s / (8 per floor) |", "|---|---|---|---|"]
    for server in servers:
        single = results.get((server, "W-single"))
        short = results.get((server, "W-short"))
        tpot = _pct(single, "tpot", "50") if single else None
        tps = short.get("output_throughput") if short else None
        cells = [f"{tpot / floor:.2f}x" if tpot else "-",
                 f"{tpot / step1:.2f}x" if tpot else "-",
                 f"{tps / (8000 / floor):.2f}" if tps else "-"]
        lines.append(f"| {SERVER_NAMES.get(server, server)} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("--servers", nargs="+",
                        help="columns in this order, the first being the baseline of the ratios "
                             "(default: vllm split colocated, those with results)")
    args = parser.parse_args(argv)
    results = load(args.results_dir)
    if not results:
        print(f"no <server>_W-*.json results in {args.results_dir}", file=sys.stderr)
        return 1
    found = {s for s, _ in results}
    servers = args.servers or ([s for s in SERVERS if s in found] + sorted(found - set(SERVERS)))
    print("\n".join([table(results, servers),
                     *floor_lines(args.results_dir, results, servers)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
