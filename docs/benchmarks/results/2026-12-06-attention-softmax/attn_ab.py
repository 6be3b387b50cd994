"""Prefill attention with bf16 products, two builds of prefill_attention_bf16.c side by side
in one process: OLD (a file, e.g. `git show REV:app/csrc/prefill_attention_bf16.c >
old.c`) against the working tree's, each compiled with the project's flags and
sources into its own library, called on the same inputs, alternated.

    .venv/bin/python docs/benchmarks/results/2026-12-06-attention-softmax/attn_ab.py OLD.c \
        [THREADS] [ROUNDS]

SmolLM2's shapes (9 query heads over 3 KV heads, head dim 64), 30 layers' worth of calls a
case: a 1,024-token prompt in one pass, and its last 256-token chunk over a 768-token past.
Prints per case the ms of each build (median, min-max over ROUNDS), new/old, the GFLOP/s of
the new one and the largest difference between the builds' outputs (relative to max |out|)."""
import ctypes, os, statistics, subprocess, sys, tempfile, time

import torch

from app import cpu_kernels

old_src, threads = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
csrc = cpu_kernels._CSRC
tmp = tempfile.mkdtemp()


def build(src: str, name: str) -> ctypes.CDLL:
    so = os.path.join(tmp, name + ".so")
    flags = [f for f in cpu_kernels.FLAGS if f]
    sources = [src if f.name == "prefill_attention_bf16.c" else str(f)
               for f in cpu_kernels.SOURCES]  # the whole library, this file swapped
    subprocess.run(["gcc", *flags, f"-I{csrc}", "-o", so, *sources, "-lm"], check=True)
    lib = ctypes.CDLL(so)
    lib.prefill_attention_bf16.restype = ctypes.c_int
    lib.prefill_attention_bf16.argtypes = (
        [ctypes.c_void_p] + [ctypes.c_long] * 3) * 3 + [ctypes.c_void_p] + [ctypes.c_long] * 3 \
        + [ctypes.c_long] * 6 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int]
    return lib


libs = {"old": build(old_src, "old"), "new": build(str(csrc / "prefill_attention_bf16.c"), "new")}
heads, kvh, d, layers = 9, 3, 64, 30
torch.manual_seed(0)


def case(s: int, past: int):
    t = past + s
    q = torch.randn(1, heads, s, d) * 2
    k, v = torch.randn(1, kvh, t, d) * 2, torch.randn(1, kvh, t, d)
    starts = torch.tensor([past], dtype=torch.long)
    flops = 4 * heads * d * sum(past + i + 1 for i in range(s))

    def run(lib):
        out = torch.empty(1, s, heads, d)
        for _ in range(layers):
            rc = lib.prefill_attention_bf16(
                q.data_ptr(), *q.stride()[:3], k.data_ptr(), *k.stride()[:3],
                v.data_ptr(), *v.stride()[:3], out.data_ptr(), out.stride(0), out.stride(2),
                out.stride(1), 1, heads, kvh, s, t, d, starts.data_ptr(), past, d ** -0.5,
                threads)
            assert rc == 0, rc
        return out
    return run, flops * layers


for label, (s, past) in {"1024 in one pass": (1024, 0), "256 after 768": (256, 768)}.items():
    run, flops = case(s, past)
    outs = {n: run(lib) for n, lib in libs.items()}
    diff = float((outs["new"] - outs["old"]).abs().max() / outs["old"].abs().max())
    ms = {"old": [], "new": []}
    for r in range(rounds):
        for n in (("old", "new") if r % 2 == 0 else ("new", "old")):
            t0 = time.perf_counter()
            run(libs[n])
            ms[n].append((time.perf_counter() - t0) * 1e3)
    ratios = sorted(b / a for a, b in zip(ms["old"], ms["new"]))
    med = {n: statistics.median(v) for n, v in ms.items()}
    print(f"{label}: old {med['old']:.1f} ms ({min(ms['old']):.1f}-{max(ms['old']):.1f}), "
          f"new {med['new']:.1f} ({min(ms['new']):.1f}-{max(ms['new']):.1f}); new/old "
          f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}); new "
          f"{flops / med['new'] / 1e6:.0f} GFLOP/s; max diff {diff:.2e}")
