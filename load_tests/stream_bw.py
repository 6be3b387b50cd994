"""The machine's read bandwidth, STREAM-style, and the decode floor it sets.

A decode step reads every weight once, so no engine decodes a lone stream faster than the
model's weight bytes divided by the bandwidth at which the cores it has can read memory. This
measures that bandwidth the way STREAM does, with a read-only sum over an array larger than
every cache (1 GiB by default), at each thread count a server uses, median of repeats, and
prints the floor for the default model's weights at each weight dtype:
``floor ms = weight bytes / bandwidth`` (one step at batch 1; larger batches read the same
bytes).

    python -m load_tests.stream_bw [--threads 1 2] [--gib 1] [--repeats 7] [--json out.json]
    python -m load_tests.stream_bw --summarize round-*/stream.json --dtype bfloat16

``load_tests/bench_peers.sh`` runs it between the servers of every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# bytes a weight takes at each weight format the engine serves
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


def read_gbs(threads: int, gib: float, repeats: int) -> list[float]:
    """GB/s of a read-only sum over ``gib`` GiB of float32, one value a repeat."""
    import torch  # here: summarizing the rounds' files needs only the standard library

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        data.sum()  # first touch and warm-up
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            out.append(data.numel() * 4 / (time.perf_counter() - start) / 1e9)
        return out
    finally:
        torch.set_num_threads(before)


def model_parameters(model: str | None) -> int:
    """Parameters of the model's weights (the embedding included: SmolLM2's output layer
    reads it as its weight)."""
    from app.config import EngineConfig
    from app.model_loader import load_model

    config = EngineConfig() if model is None else EngineConfig(model=model)
    return sum(p.numel() for p in load_model(config).parameters())


def report(threads: list[int], gib: float, repeats: int, params: int) -> dict:
    out: dict = {"gib": gib, "repeats": repeats, "parameters": params, "threads": {}}
    for t in threads:
        values = read_gbs(t, gib, repeats)
        gbs = statistics.median(values)
        out["threads"][str(t)] = {
            "read_gb_per_s": gbs, "min": min(values), "max": max(values),
            "floor_ms": {dtype: params * size / (gbs * 1e9) * 1000
                         for dtype, size in WEIGHT_BYTES.items()}}
    return out


def format_report(rep: dict) -> str:
    lines = [f"read bandwidth (sum over {rep['gib']:g} GiB, median of {rep['repeats']}) and the "
             f"decode floor for {rep['parameters'] / 1e6:.0f}M parameters",
             f"{'threads':>7} {'GB/s':>7} {'min-max':>13}  " +
             "  ".join(f"floor {d} ms" for d in WEIGHT_BYTES)]
    for t, r in rep["threads"].items():
        lines.append(f"{t:>7} {r['read_gb_per_s']:>7.1f} {r['min']:>6.1f}-{r['max']:<6.1f}  " +
                     "  ".join(f"{r['floor_ms'][d]:>{len(d) + 9}.2f}" for d in WEIGHT_BYTES))
    return "\n".join(lines)


def summarize(paths: list[str], dtype: str) -> str:
    """A markdown table over rounds' ``--json`` files: per thread count the median read
    bandwidth with its min-max over the rounds, and the decode floor at ``dtype``."""
    reps = [json.load(open(p)) for p in paths]
    lines = [f"| threads | read GB/s (median, min-max, {len(reps)} rounds) | "
             f"decode floor at {dtype}, ms a step | the same, tokens/s at batch 1 |",
             "|---|---|---|---|"]
    for t in sorted({t for r in reps for t in r["threads"]}, key=int):
        gbs = [r["threads"][t]["read_gb_per_s"] for r in reps if t in r["threads"]]
        floors = [r["threads"][t]["floor_ms"][dtype] for r in reps if t in r["threads"]]
        floor = statistics.median(floors)
        lines.append(f"| {t} | {statistics.median(gbs):.1f} ({min(gbs):.1f}-{max(gbs):.1f}) | "
                     f"{floor:.2f} | {1000 / floor:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--gib", type=float, default=1.0, help="array size (larger than caches)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--model", default=None, help="whose weights set the floor (default model)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--summarize", nargs="+", metavar="JSON", default=None,
                    help="no measuring: a table over these rounds' --json files")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(WEIGHT_BYTES),
                    help="the weights' dtype for --summarize's floor")
    args = ap.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize, args.dtype))
        return 0
    rep = report(args.threads, args.gib, args.repeats, model_parameters(args.model))
    print(format_report(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
