"""bf16 dot-product panels alone, one thread: SmolLM2's prefill-sized products (rows x k x n)
and its prefill attention (heads, KV heads, head dim, tokens), GFLOP/s, median of 5 runs of
10 (products) or median of 7 (attention). Run from a checkout (or a worktree of another
commit, to compare): .venv/bin/python docs/benchmarks/results/2026-12-05-tile-setup/products.py
"""
import time

import torch
import torch.nn as nn

from app.packed_linear import PanelLinear
from app.prefill_attention import _kernel_prefill_attention

torch.set_num_threads(1)
torch.manual_seed(0)
with torch.inference_mode():
    for m, k, n in [(512, 576, 960), (512, 576, 3072), (512, 1536, 576), (1024, 576, 3072),
                    (48, 576, 3072)]:
        panel = PanelLinear(nn.Linear(k, n, bias=False), weights="bfloat16dp")
        x = torch.randn(m, k)
        for _ in range(3):
            panel(x)
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(10):
                panel(x)
            runs.append((time.perf_counter() - t) / 10)
        s = sorted(runs)[2]
        print(f"product {m} x {k} x {n}: {s * 1e3:.2f} ms, {2 * m * k * n / s / 1e9:.1f} GFLOP/s")
    for heads, kv_heads, d, s_len in [(9, 3, 64, 1024), (9, 3, 64, 256)]:
        q = torch.randn(1, s_len, heads, d).transpose(1, 2)
        k = torch.randn(1, kv_heads, s_len, d)
        v = torch.randn(1, kv_heads, s_len, d)
        starts = torch.tensor([0])
        for _ in range(2):
            _kernel_prefill_attention(q, k, v, starts, 0, None, bf16=True)
        runs = []
        for _ in range(7):
            t = time.perf_counter()
            _kernel_prefill_attention(q, k, v, starts, 0, None, bf16=True)
            runs.append(time.perf_counter() - t)
        s = sorted(runs)[3]
        flops = 2 * 2 * heads * d * s_len * s_len / 2
        print(f"attention {heads}/{kv_heads} heads, d {d}, {s_len} tokens: {s * 1e3:.2f} ms, "
              f"{flops / s / 1e9:.1f} GFLOP/s")
