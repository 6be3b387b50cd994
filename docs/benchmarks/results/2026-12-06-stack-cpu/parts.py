import sys, time, statistics, collections
from app.config import EngineConfig
from app.engine_core import EngineCore
from load_tests.decode_bench import Batch
import app.decode as dec, app.model_runner as mr, app.attention as att
core = EngineCore.here(EngineConfig(model="smollm2-135m-instruct", dtype=sys.argv[1], num_threads=2, **({"weights": sys.argv[2]} if sys.argv[2] != "-" else {})))
acc = collections.defaultdict(list)
def timed(name, fn):
    def w(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); acc[name].append(time.perf_counter() - t); return r
    return w
lib = core.runner.fused._lib
class Wrap:
    def __getattr__(self, n): return getattr(lib, n)
core.runner.fused._lib = Wrap(); core.runner.fused._lib.decode_step = timed("C decode_step", lib.decode_step)
core.runner.decode = timed("runner.decode", core.runner.decode)
core.runner.rotary_emb = timed("rotary", core.runner.rotary_emb)
core.runner.embed_tokens = timed("embed", core.runner.embed_tokens)
dec.sample_tokens = timed("sample_tokens", dec.sample_tokens)
dec.token_logprobs = timed("token_logprobs", dec.token_logprobs)
att.PagedDecodeStep.build = classmethod(timed("build", att.PagedDecodeStep.build.__func__))
for bs in (1, 8):
    b = Batch(core, [64] * bs, seed=bs)
    for _ in range(5): b.step()
    acc.clear(); total = []
    for _ in range(100):
        t = time.perf_counter(); b.step(); total.append(time.perf_counter() - t)
    print(f"batch {bs}: step {statistics.median(total)*1e3:.2f} ms; " + ", ".join(f"{k} {statistics.median(v)*1e6:.0f} us" for k, v in acc.items()))
