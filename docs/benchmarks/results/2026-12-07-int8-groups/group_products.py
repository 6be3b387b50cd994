"""One product alone over int8 pair panels (int8dp, AVX512-VNNI) with a scale per output
(group 0) and per 256, 128 and 32 of k: SmolLM2's gate/up and down shapes (in cache) and its
LM head (49152 x 576, from memory), 1 and 8 rows, one thread; the median of 5 interleaved
rounds, in microseconds.

    .venv/bin/python docs/benchmarks/results/2026-12-07-int8-groups/group_products.py
"""
import time

import torch
from torch import nn

from app.packed_linear import PanelLinear

torch.set_num_threads(1)
torch.manual_seed(0)
for (n, k) in [(1536, 576), (576, 1536), (49152, 576)]:
    lin = nn.Linear(k, n, bias=False)
    pls = {g: PanelLinear(lin, weights="int8dp", group=g) for g in (0, 256, 128, 32)}
    for m in (1, 8):
        x = torch.randn(m, k)
        t = {g: [] for g in pls}
        reps = max(1, 3000000 // (n * k // 16))
        for _ in range(5):
            for g, p in pls.items():
                t0 = time.perf_counter()
                for _ in range(reps):
                    p(x)
                t[g].append((time.perf_counter() - t0) / reps * 1e6)
        print(f"n {n} k {k} rows {m}:",
              {f"g{g}": round(sorted(v)[2], 1) for g, v in t.items()})
