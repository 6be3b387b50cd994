"""In-process W-long (wlong_inproc.py, 2 rounds) with every call into the kernel library
timed (a proxy around load_kernel's CDLL): the passes' time (pass compute) against the
kernels' within them; the rest is the engine thread's Python and torch work, during which
the OpenMP worker waits. Run from a tree's root: PYTHONPATH=. .venv/bin/python <this>/serial.py"""
"""In-process W-long: time in the kernel library's calls vs the mixed passes' wall time."""
import sys, time, collections, runpy
import app.cpu_kernels as ck
lib = ck.load_kernel()
T = collections.Counter(); N = collections.Counter()

class Timed:
    def __init__(self, f, name): self.f, self.name = f, name
    def __call__(self, *a):
        t = time.perf_counter(); r = self.f(*a); T[self.name] += time.perf_counter() - t; N[self.name] += 1; return r
    def __getattr__(self, k): return getattr(self.f, k)

class Proxy:
    def __init__(self, lib): self.__dict__['_lib'] = lib; self.__dict__['_c'] = {}
    def __getattr__(self, k):
        c = self.__dict__['_c']
        if k not in c:
            v = getattr(self.__dict__['_lib'], k)
            c[k] = Timed(v, k) if callable(v) else v
        return c[k]
P = Proxy(lib)
ck.load_kernel = lambda *a, **kw: P
import app.engine_core  # noqa
from app import model_runner
for mod in list(sys.modules.values()):
    if getattr(mod, '__name__', '').startswith('app.') and getattr(mod, 'load_kernel', None) is not None:
        mod.load_kernel = ck.load_kernel
sys.argv = ['x', '2', '--log']
g = runpy.run_path('docs/benchmarks/results/2026-12-06-wlong-schedule/wlong_inproc.py', run_name='__main__')
tot = sum(T.values())
print('kernel calls total %.2f s' % tot)
for k, v in T.most_common(): print(f'  {k}: {v:.2f} s, {N[k]} calls, {1e6*v/N[k]:.0f} us/call')
