"""In one process, W-long rounds alternating the new mixed-pass path (kv_store_rows, one output
buffer, spare KV buffers) with the previous one (torch's copies, a concatenation, fresh
buffers), the rounds' order in $ORDER (n: new, o: previous), from the repo root:
    ORDER=nonnoonnoonnoo PYTHONPATH=. .venv/bin/python <this folder>/toggle.py"""
import asyncio, random, sys, time, torch
import app.attention as at
import app.kv_cache as kc
from app.decode_attention import decode_attention
from app.prefill_attention import _kernel_prefill_attention, _kernel_serves
from transformers.integrations.sdpa_attention import sdpa_attention_forward
sys.argv = ['x', '0']
g = {}
exec(open('docs/benchmarks/results/2026-12-06-wlong-schedule/wlong_inproc.py').read().replace('for r in range(rounds):', 'for r in range(0):'), g)
new_mixed, new_build, take0, give0 = at._mixed_attention, at.MixedStep.build, kc.SpareBuffers.take, kc.SpareBuffers.give

def old_mixed(module, query, step, scaling, dropout, kwargs):
    decode_kv, chunk_kv = step.current
    step.current = None
    _, heads, _, head_dim = query.shape
    rows = step.rows
    outs = []
    if rows:
        q = query[0, :, :rows].transpose(0, 1).unsqueeze(2)
        out = decode_attention(q, decode_kv[0], decode_kv[1], step.decode, scaling)
        outs.append(out.reshape(1, rows, heads, head_dim))
    start = rows
    for i, ((k, v), n) in enumerate(zip(chunk_kv, step.chunk_lens)):
        q = query[:, :, start:start + n]
        outs.append(_kernel_prefill_attention(q, k, v, step.kernel_starts[i], step.past_lens[i], scaling, step.prefill_bf16))
        start += n
    return torch.cat(outs, dim=1), None

def old_build(*a, **kw):
    s = new_build(*a, **kw); s.kv_kernel = False; return s

def mode(m):
    if m == 'n':
        at._mixed_attention, at.MixedStep.build = new_mixed, new_build
        kc.SpareBuffers.take, kc.SpareBuffers.give = take0, give0
    else:
        at._mixed_attention, at.MixedStep.build = old_mixed, staticmethod(old_build)
        kc.SpareBuffers.take = lambda self, shape, dtype, device: torch.empty(shape, dtype=dtype, device=device)
        kc.SpareBuffers.give = lambda self, t: None


import os
order = os.environ.get('ORDER', 'nooonnoo')
for r, m in enumerate(order):
    mode(m)
    print(m, end=' ', flush=True)
    asyncio.run(g['run'](100 + r))
