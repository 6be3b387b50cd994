import gc, sys, time, statistics
from app.config import EngineConfig
from app.engine_core import EngineCore
from load_tests.decode_bench import Batch
core = EngineCore.here(EngineConfig(model=sys.argv[1], dtype="bfloat16", num_threads=int(sys.argv[2])))
bs = int(sys.argv[3])
stats = {}; t0 = [0.0]
def cb(phase, info):
    if phase == "start": t0[0] = time.perf_counter()
    else:
        g = info["generation"]; n, t = stats.get(g, (0, 0.0)); stats[g] = (n + 1, t + time.perf_counter() - t0[0])
gc.callbacks.append(cb)
for freeze in (False, True, False, True):
    gc.collect()
    if freeze: gc.freeze()
    b = Batch(core, [64] * bs, seed=3)
    stats.clear(); steps = 150
    t = time.perf_counter()
    for _ in range(steps): b.step()
    el = time.perf_counter() - t
    tot = sum(v[1] for v in stats.values())
    print(f"{'frozen' if freeze else 'plain '} step {el/steps*1e3:.2f} ms, gc {tot/steps*1e3:.3f} ms/step ({100*tot/el:.1f}%): " + ", ".join(f"gen{g} {n}x {t*1e3/max(n,1):.2f} ms" for g, (n, t) in sorted(stats.items())))
    if freeze: gc.unfreeze()
print("tracked", len(gc.get_objects()))
