"""Mixed batching on the engine (the colocated app's ``mixed_batch``): a decode step and a
prompt chunk in one forward pass against the two passes run one after the other.

Prints, on one engine thread (the colocated replica's threads: ``--threads``):

Wall and CPU time (``*_cpu_ms``: the engine thread's, which on one thread is the passes'
compute, less sensitive to other work on a shared machine).

* **one pass against two**: a 256-token prompt chunk (``Prefiller.run_pass``) plus a
  batch-8 decode step (``Decoder.step``, 64-token contexts) run separately, against one
  ``Decoder.step(plan)`` that carries the same 256 prompt tokens and the 8 decode rows;
* **streams while a prompt is prefilled**: 8 running greedy streams while a 1024-token
  prompt is prefilled, on the colocated schedule with ``mixed_batch: false`` (a chunk pass,
  a decode step, a chunk pass, ...) and with it on (each step carries a chunk of
  ``prefill_chunk_tokens`` minus the decode rows): the streams' inter-token gaps during the
  prefill and the prompt's time to its package.

Rounds interleave the two schedules, so a busy spell of a shared machine hits both alike.

    python -m load_tests.mixed_bench [--threads 1] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from app.config import DEFAULT_MODEL, EngineConfig
from app.engine_core import EngineCore
from app.messages import PrefillRequest
from app.prefill import ChunkPlan, Prefiller, PrefillJob
from app.sampling import SamplingParams
from load_tests.decode_bench import CONTEXT, Batch

CHUNK = 256
PROMPT = 1024
ROWS = 8
PASS_REPEATS = 3  # one-pass-against-two samples per round
DOC_SAMPLING = SamplingParams(max_tokens=16, temperature=0.0)


def _doc(prefiller: Prefiller, seed: int, n: int = PROMPT) -> PrefillJob:
    rng = random.Random(seed)
    prompt = tuple(rng.randrange(100, 20000) for _ in range(n))
    return prefiller.new_job(PrefillRequest(f"doc{seed}", prompt, DOC_SAMPLING))


def _timed(fn) -> tuple[float, float]:
    """Wall and CPU milliseconds of ``fn()``. With one torch thread every op runs on the
    calling thread, so its CPU time is the pass's compute, whatever else shares the cores."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return (time.perf_counter() - wall) * 1000, (time.thread_time() - cpu) * 1000


def one_pass_vs_two(batch: Batch, prefiller: Prefiller, seed: int) -> dict[str, float]:
    """Milliseconds (wall, and CPU as ``*_cpu_ms``): a 256-token chunk pass, a batch-8
    step, and both in one mixed step (each chunk the first of a fresh 1024-token prompt, so
    no prompt finishes)."""
    chunk = _timed(lambda: prefiller.run_pass([_doc(prefiller, seed)]))
    step = _timed(batch.step)
    job = _doc(prefiller, seed + 1)
    mixed = _timed(lambda: batch.decoder.step(ChunkPlan(prefiller, [job], [CHUNK])))
    out = {}
    for i, suffix in enumerate(("_ms", "_cpu_ms")):
        out.update({"chunk256" + suffix: chunk[i], "step8" + suffix: step[i],
                    "separate" + suffix: chunk[i] + step[i], "mixed" + suffix: mixed[i]})
    return out


def streams_during_prefill(batch: Batch, prefiller: Prefiller, mixed: bool,
                           seed: int) -> dict[str, float]:
    """The colocated engine's schedule while a 1024-token prompt is prefilled and 8 streams
    decode: the gaps between the streams' tokens, and the prompt's time to its package."""
    job = _doc(prefiller, seed)
    gaps, start, cpu = [], time.perf_counter(), time.thread_time()
    last = start
    package = None
    while package is None:
        if mixed:
            plan = prefiller.plan_chunks([job], len(batch.decoder.running))
            batch.decoder.step(plan)
            [package] = plan.packages
        else:
            [package] = prefiller.run_pass([job])
            batch.step()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    cpu = time.thread_time() - cpu
    return {"gap_mean_ms": statistics.mean(gaps) * 1000, "gap_max_ms": max(gaps) * 1000,
            "gaps": len(gaps), "prompt_to_package_ms": (last - start) * 1000,
            "gap_mean_cpu_ms": cpu / len(gaps) * 1000, "prompt_to_package_cpu_ms": cpu * 1000}


def measure(threads: int, rounds: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(threads)
    core = EngineCore.here(EngineConfig(model=DEFAULT_MODEL, num_threads=threads,
                                        prefill_chunk_tokens=CHUNK, prefix_cache_mb=0))
    prefiller = core.make_prefiller()
    batch = Batch(core, [CONTEXT] * ROWS, seed=2)
    one_pass_vs_two(batch, prefiller, seed=0)  # warm both paths
    rows: dict[str, dict[str, list[float]]] = {"passes": {}, "separate": {}, "mixed": {}}
    for r in range(rounds):
        for i in range(PASS_REPEATS):
            for key, value in one_pass_vs_two(batch, prefiller, seed=100 * r + i).items():
                rows["passes"].setdefault(key, []).append(value)
        for name in ("separate", "mixed"):
            figures = streams_during_prefill(batch, prefiller, name == "mixed", seed=20 + r)
            for key, value in figures.items():
                rows[name].setdefault(key, []).append(value)
    out = {name: {k: statistics.median(v) for k, v in figs.items()}
           for name, figs in rows.items()}
    p = out["passes"]
    p["mixed_over_separate"] = p["mixed_ms"] / p["separate_ms"]
    p["mixed_over_separate_cpu"] = p["mixed_cpu_ms"] / p["separate_cpu_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    results = measure(args.threads, args.rounds)
    print(f"mixed batching, {args.threads} thread(s), {ROWS} streams of {CONTEXT}-token "
          f"contexts, {CHUNK}-token chunks (medians of {args.rounds} rounds; the passes "
          f"{PASS_REPEATS} times a round)")
    for key, value in results["passes"].items():
        print(f"  {key:<26}{value:>10.2f}")
    print(f"8 streams while a {PROMPT}-token prompt is prefilled")
    print(f"  {'figure':<26}{'separate':>10}{'mixed':>10}")
    for key in results["separate"]:
        print(f"  {key:<26}{results['separate'][key]:>10.1f}{results['mixed'][key]:>10.1f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
