import sys, time, statistics, torch
from app.config import EngineConfig
from app.engine_core import EngineCore
from load_tests.decode_bench import Batch
import app.fused_decode as fd
dtype, weights, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = dict(model=sys.argv[4] if len(sys.argv) > 4 else "smollm2-135m-instruct", dtype=dtype, num_threads=threads)
if weights != "-": cfg["weights"] = weights
core = EngineCore.here(EngineConfig(**cfg))
inner = []
orig = fd.FusedDecode.__call__
lib = core.runner.fused._lib
c_ds = lib.decode_step
class Wrap:
    def __getattr__(self, n): return getattr(lib, n)
    def decode_step(self, *a):
        t = time.perf_counter(); r = c_ds(*a); inner.append(time.perf_counter() - t); return r
core.runner.fused._lib = Wrap()
for bs in (1, 8):
    b = Batch(core, [64] * bs, seed=bs)
    outer = []
    for _ in range(5): b.step()
    inner.clear()
    for _ in range(60):
        t = time.perf_counter(); b.step(); outer.append(time.perf_counter() - t)
    o, i = statistics.median(outer) * 1e3, statistics.median(inner) * 1e3
    print(f"{dtype} {weights} t{threads} batch {bs}: step {o:.2f} ms, C decode_step {i:.2f} ms, outside {o-i:.2f} ms")
