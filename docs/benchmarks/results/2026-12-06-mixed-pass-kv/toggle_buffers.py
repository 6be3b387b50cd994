"""In one process, W-long rounds alternating the fused layers' per-thread buffers (2f2a971,
n) with fresh ones each layer (o), the order in $ORDER, from the repo root:
    ORDER=noonnoonno PYTHONPATH=. .venv/bin/python <this folder>/toggle_buffers.py"""
import asyncio, os, sys, torch
import app.fused_layers as fl
sys.argv = ['x', '0']
g = {}
exec(open('docs/benchmarks/results/2026-12-06-wlong-schedule/wlong_inproc.py').read().replace('for r in range(rounds):', 'for r in range(0):'), g)
kept = fl.FusedLayers._buffer
fresh = lambda self, name, shape: torch.empty(shape, dtype=torch.float32)
for r, m in enumerate(os.environ.get('ORDER', 'noonnoonno')):
    fl.FusedLayers._buffer = kept if m == 'n' else fresh
    print(m, end=' ', flush=True)
    asyncio.run(g['run'](100 + r))
