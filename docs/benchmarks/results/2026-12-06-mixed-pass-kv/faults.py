"""Minor page faults (the whole process's) around each kernel call of the fused layers, each
mixed pass, its logits and each prompt's package, over one in-process W-long round
(wlong_inproc.py). From the repo root: PYTHONPATH=. .venv/bin/python <this folder>/faults.py"""
import sys, runpy, resource, collections, time
import app.fused_layers as fl, app.cpu_kernels as ck
C = collections.Counter()
def ru(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
class P:
    def __init__(s, lib): s.lib = lib
    def __getattr__(s, k):
        f = getattr(s.lib, k)
        def g(*a):
            r0 = ru(); r = f(*a); C[k] += ru() - r0; return r
        return g
o = fl.FusedLayers.__init__
def init(self, *a, **kw):
    o(self, *a, **kw); self._lib = P(self._lib)
fl.FusedLayers.__init__ = init
import app.model_runner as mr
for name in ('forward_mixed', '_layers_forward', '_logits'):
    f0 = getattr(mr.ModelRunner, name)
    def mk(f0, name):
        def g(*a, **kw):
            r0 = ru(); r = f0(*a, **kw); C[name] += ru() - r0; return r
        return g
    setattr(mr.ModelRunner, name, mk(f0, name))
import app.prefill as pf
f0 = pf.Prefiller._package
def pk(*a, **kw):
    r0 = ru(); r = f0(*a, **kw); C['_package'] += ru() - r0; return r
pf.Prefiller._package = pk
r0 = ru()
sys.argv = ['x', '1']
runpy.run_path('docs/benchmarks/results/2026-12-06-wlong-schedule/wlong_inproc.py', run_name='__main__')
C['total'] = ru() - r0
print(dict(C))
