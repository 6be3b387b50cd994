"""In one process, W-long rounds (wlong_inproc.py) alternating a mixed pass as one kernel
call (FusedLayers.pass_call at 49ecc92: FusedLayers.mixed_pass, n) with the layer-by-layer Python loop (o), the order in
$ORDER, from the repo root:
    ORDER=noonnoonno PYTHONPATH=. .venv/bin/python <this folder>/toggle.py"""
import asyncio, os, sys
import app.fused_layers as fl
sys.argv = ['x', '0']
g = {}
exec(open('docs/benchmarks/results/2026-12-06-wlong-schedule/wlong_inproc.py').read().replace('for r in range(rounds):', 'for r in range(0):'), g)
one_call = fl.FusedLayers.pass_call
for r, m in enumerate(os.environ.get('ORDER', 'noonnoonno')):
    fl.FusedLayers.pass_call = one_call if m == 'n' else (lambda *a, **k: None)
    print(m, end=' ', flush=True)
    asyncio.run(g['run'](100 + r))
