"""In-process W-long (wlong_inproc.py, 2 rounds) with timers around each part of
FusedLayers.layer (a copy of it with perf_counter calls): what a layer of a mixed pass
spends outside its kernels. Works on either tree (the decode attention's name changed):
    cd <tree> && PYTHONPATH=. .venv/bin/python <this folder>/layer_t.py"""
import sys, time, collections, runpy, torch
import app.fused_layers as fl
from app.fused_layers import *  # noqa
from app.fused_layers import _ptr, IN_NORM, QKV, QKV_BIAS, OUT, O_BIAS, POST_NORM, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, QKV_SCALE, O_SCALE, GATE_UP_SCALE, DOWN_SCALE
from app.cpu_kernels import assert_kernel_tensors, check
T = collections.Counter()
def layer(self, index, hidden, rotary, mask, cache, **attention_kwargs):
    c = time.perf_counter; t0 = c()
    bsz, seq, h = hidden.shape
    m = bsz * seq
    nq, nkv = self.heads * self.head_dim, self.kv_heads * self.head_dim
    x = hidden.contiguous()
    cos, sin = rotary
    assert_kernel_tensors(hidden=(x, torch.float32), cos=(cos, torch.float32), sin=(sin, torch.float32))
    w = self.weights[index]
    xn = torch.empty((m, h), dtype=torch.float32)
    qkv = torch.empty((m, nq + 2 * nkv), dtype=torch.float32)
    threads = torch.get_num_threads()
    t1 = c(); T['a.pre'] += t1 - t0
    check(self._lib.layer_qkv(
        x.data_ptr(), m, h, w[IN_NORM].data_ptr(), self.eps, w[QKV].data_ptr(), self.wtype,
        _ptr(w[QKV_SCALE]), _ptr(w[QKV_BIAS]), self.heads, self.kv_heads, self.head_dim,
        cos.data_ptr(), sin.data_ptr(), xn.data_ptr(), qkv.data_ptr(), threads), "layer_qkv")
    t2 = c(); T['b.qkv'] += t2 - t1
    hd = self.head_dim
    q = qkv[:, :nq].view(bsz, seq, self.heads, hd).transpose(1, 2)
    keep = getattr(cache, "keeps_kv", True); T['keeps'] += keep
    kv = qkv[:, nq:].clone() if keep else qkv[:, nq:]
    t3 = c(); T['c.views+clone'] += t3 - t2
    k = kv[:, :nkv].view(bsz, seq, self.kv_heads, hd).transpose(1, 2)
    v = kv[:, nkv:].view(bsz, seq, self.kv_heads, hd).transpose(1, 2)
    attn = self.attn[index]
    k, v = cache.update(k, v, attn.layer_idx)
    t4 = c(); T['d.update'] += t4 - t3
    window = ({"sliding_window": attn.sliding_window} if hasattr(attn, "sliding_window") else {})
    out, _ = fl.paged_attention(attn, q, k, v, mask, scaling=attn.scaling, dropout=0.0, **window, **attention_kwargs)
    t5 = c(); T['e.attention'] += t5 - t4
    att = out.reshape(m, nq).float().contiguous()
    scratch = torch.empty(m * (h + 3 * self.inter), dtype=torch.float32)
    t6 = c(); T['f.att+scratch'] += t6 - t5
    check(self._lib.layer_mlp(
        x.data_ptr(), m, h, att.data_ptr(), nq, w[OUT].data_ptr(), _ptr(w[O_SCALE]),
        _ptr(w[O_BIAS]), w[POST_NORM].data_ptr(), self.eps, w[GATE_UP].data_ptr(),
        _ptr(w[GATE_UP_SCALE]), _ptr(w[GATE_UP_BIAS]), self.inter, w[DOWN].data_ptr(),
        _ptr(w[DOWN_SCALE]), _ptr(w[DOWN_BIAS]), self.wtype, scratch.data_ptr(), threads), "layer_mlp")
    t7 = c(); T['g.mlp'] += t7 - t6; T['n'] += 1
    return x.view(bsz, seq, h)
fl.FusedLayers.layer = layer
import app.attention as at
import app.prefill_attention as pam
for name in ('_kernel_prefill_attention', 'inplace_decode_attention', '_inplace_attention'):
    if not hasattr(at, name): continue
    f0 = getattr(at, name)
    def mk(f0, name):
        def g(*a, **kw):
            t = time.perf_counter(); r = f0(*a, **kw); T['e.' + name] += time.perf_counter() - t; return r
        return g
    setattr(at, name, mk(f0, name))
sys.argv = ['x', '2']
runpy.run_path('docs/benchmarks/results/2026-12-06-wlong-schedule/wlong_inproc.py', run_name='__main__')
n = T['n']
for k, v in sorted(T.items()): print(f'{k:32s} {v:9.3f}  {1e6*v/n:8.1f} us/layer')
