"""bf16 products, two builds of panel_bf16dp.c in one process, alternated: OLD.c against the
working tree's. SmolLM2's four products a layer over 30 layers' weights (cold: 210 MB),
M rows on one thread (a prefill layer's block of rows)."""
import ctypes, os, statistics, subprocess, sys, tempfile, time
import torch
from app import cpu_kernels

old_src = sys.argv[1]
ms_rows = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "64,256").split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
csrc, tmp = cpu_kernels._CSRC, tempfile.mkdtemp()

def build(src, name):
    so = os.path.join(tmp, name + ".so")
    sources = [src if f.name == "panel_bf16dp.c" else str(f) for f in cpu_kernels.SOURCES]
    subprocess.run(["gcc", *[f for f in cpu_kernels.FLAGS if f], f"-I{csrc}", "-o", so, *sources, "-lm"], check=True)
    lib = ctypes.CDLL(so)
    lib.linear_bf16dp.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.panel_pack_pairs.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    lib.panel_pair_elems.restype = ctypes.c_long
    lib.panel_pair_elems.argtypes = [ctypes.c_long, ctypes.c_long]
    return lib

libs = {"old": build(old_src, "old"), "new": build(str(csrc / "panel_bf16dp.c"), "new")}
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (n, k)
lib0 = libs["old"]
layers = []
for _ in range(30):
    ws = []
    for n, k in shapes:
        w = (torch.randn(n, k) * 0.05).to(torch.bfloat16).view(torch.int16)
        p = torch.empty(lib0.panel_pair_elems(n, k), dtype=torch.int16)
        lib0.panel_pack_pairs(w.data_ptr(), k, n, k, p.data_ptr())
        ws.append((n, k, p, torch.zeros(n)))
    layers.append(ws)
for m in ms_rows:
    xs = {k: torch.randn(m, k) for k in (576, 1536)}
    ys = {n: torch.empty(m, n) for n in (960, 576, 3072)}
    flops = 2 * m * sum(n * k for n, k in shapes) * 30
    def run(lib):
        for ws in layers:
            for n, k, p, b in ws:
                assert lib.linear_bf16dp(xs[k].data_ptr(), m, k, p.data_ptr(), n, b.data_ptr(), ys[n].data_ptr(), 1) == 0
        return ys[576].clone()
    a, b = run(libs["old"]), run(libs["new"])
    assert torch.equal(a, b)
    t = {"old": [], "new": []}
    for r in range(rounds):
        for nme in (("old", "new") if r % 2 == 0 else ("new", "old")):
            t0 = time.perf_counter(); run(libs[nme]); t[nme].append((time.perf_counter() - t0) * 1e3)
    rat = sorted(y / x for x, y in zip(t["old"], t["new"]))
    md = {k: statistics.median(v) for k, v in t.items()}
    print(f"m={m}: old {md['old']:.1f} ms, new {md['new']:.1f} ms; new/old {statistics.median(rat):.3f} ({rat[0]:.3f}-{rat[-1]:.3f}); old {flops/md['old']/1e6:.0f} new {flops/md['new']/1e6:.0f} GFLOP/s; outputs equal")
