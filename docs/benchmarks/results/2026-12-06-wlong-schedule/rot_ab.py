"""Decode steps with the rotary table against the module's call each step, same process,
alternated: python rot_ab.py WEIGHTS(bf16|int8) THREADS BATCH ROUNDS"""
import statistics, sys, time
import torch
from app.config import EngineConfig
from app.engine_core import EngineCore
from load_tests.decode_bench import Batch
w, threads, bs, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = dict(model="smollm2-135m-instruct", dtype="bfloat16", num_threads=threads, prefix_cache_mb=0)
if w == "int8": cfg["weights"] = "int8"
core = EngineCore.here(EngineConfig(**cfg))
fused = core.runner.fused
table = fused._rotary_table
b = Batch(core, [64] * bs, seed=3)
res = {"table": [], "module": []}
for r in range(rounds):
    for side in (("table", "module") if r % 2 == 0 else ("module", "table")):
        fused._rotary_table = table if side == "table" else None
        for _ in range(5): b.step()
        t = time.perf_counter(); n = 40
        for _ in range(n): b.step()
        res[side].append((time.perf_counter() - t) / n * 1e3)
ratios = [a / m for a, m in zip(res["table"], res["module"])]
print(f"{w} threads {threads} batch {bs}: table {statistics.median(res['table']):.3f} ms, module {statistics.median(res['module']):.3f} ms, "
      f"ratio {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}), {rounds} rounds")
