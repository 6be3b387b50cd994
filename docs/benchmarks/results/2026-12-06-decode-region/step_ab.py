"""A decode step through this checkout's kernels against another build's, in one process.

    python step_ab.py THREADS MODEL ROUNDS BASELINE_SO

BASELINE_SO: the kernel library of the tree to compare with, built with its own cache, e.g.

    git worktree add /tmp/base <commit>
    cd /tmp/base && SPLITSERVE_CACHE=/tmp/base-cache PYTHONPATH=/tmp/base \
        <this checkout>/.venv/bin/python -m app.cpu_kernels   # prints the .so's path

Run from this checkout (PYTHONPATH=.). One engine (bf16, THREADS threads) runs a batch of 1
and a batch of 8 over 64-token contexts (load_tests.decode_bench's Batch); each round times
10 steps of each batch through each library's decode_step (the order alternating by round),
every step on the engine's own thread, where the model was loaded (one OpenMP team, as in a
replica). Prints each batch's medians and the median of the rounds' new/baseline ratios with
their min-max.
"""
import ctypes
import statistics
import sys
import time

from app import cpu_kernels
from app.config import EngineConfig
from app.engine_core import EngineCore
from load_tests.decode_bench import Batch

threads, model, rounds, baseline = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
core = EngineCore(EngineConfig(model=model, dtype="bfloat16", num_threads=threads))


def on(fn):
    return core.thread.submit(fn).result()


restype, argtypes = cpu_kernels.declarations(cpu_kernels.HEADER.read_text())["decode_step"]
libs = {"new": cpu_kernels.load_kernel(), "base": ctypes.CDLL(baseline)}
libs["base"].decode_step.restype, libs["base"].decode_step.argtypes = restype, argtypes
fused = core.runner.fused
batches = {"b1": on(lambda: Batch(core, [64], seed=1)),
           "b8": on(lambda: Batch(core, [64] * 8, seed=2))}


def timed(batch, lib, steps=10):
    fused._lib = lib

    def go():
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            batch.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000
    return on(go)


res = {(b, name): [] for b in batches for name in libs}
for r in range(rounds):
    for name in (("base", "new") if r % 2 == 0 else ("new", "base")):
        for b, batch in batches.items():
            res[b, name].append(timed(batch, libs[name]))
for b in batches:
    ratios = [n / o for n, o in zip(res[b, "new"], res[b, "base"])]
    print(f"{model} threads={threads} {b}: base {statistics.median(res[b, 'base']):.2f} ms, "
          f"new {statistics.median(res[b, 'new']):.2f} ms, new/base "
          f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}, {rounds} rounds)")
