import random, statistics, time, sys, torch
from app.config import EngineConfig
from app.engine_core import EngineCore
torch.set_num_threads(2)
core = EngineCore.here(EngineConfig(dtype="auto", num_threads=2, **({"model": sys.argv[1]} if len(sys.argv) > 1 else {})))
prompt = [random.Random(3).randrange(100, 20000) for _ in range(64)]
for r in range(3):
    for t in (1, 2):
        torch.set_num_threads(t)
        xs = []
        for _ in range(7):
            s = time.perf_counter(); core.runner.forward_prefill([prompt]); xs.append(time.perf_counter() - s)
        print(f"threads {t}: 64-token pass {statistics.median(xs)*1000:.1f} ms", flush=True)
