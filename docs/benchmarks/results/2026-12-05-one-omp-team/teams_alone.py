"""pass_bench's variant, its rounds on the main thread (two OpenMP teams: the engine thread's
from loading and packing, the main thread's) against the same rounds on the engine thread
(one team), alternated."""
import statistics, sys, torch
from load_tests.pass_bench import Variant, FIGURES
torch.set_num_threads(2)
v = Variant("bfloat16", 2)
v.core.thread.submit(v.round).result(); v.round()
res = {"main": {f: [] for f in FIGURES}, "engine": {f: [] for f in FIGURES}}
for r in range(int(sys.argv[1])):
    for where in ("engine", "main") if r % 2 else ("main", "engine"):
        v.rows = {f: [] for f in FIGURES}
        (v.round() if where == "main" else v.core.thread.submit(v.round).result())
        for f in FIGURES: res[where][f].append(v.rows[f][0])
for f in FIGURES:
    m, e = res["main"][f], res["engine"][f]
    rat = [a / b for a, b in zip(e, m)]
    print(f"{f:16s} main {statistics.median(m):7.1f} ({min(m):.0f}-{max(m):.0f})  engine {statistics.median(e):7.1f} ({min(e):.0f}-{max(e):.0f})  engine/main {statistics.median(rat):.2f}x ({min(rat):.2f}-{max(rat):.2f})")
