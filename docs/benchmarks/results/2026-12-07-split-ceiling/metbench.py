import time, ray
ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
@ray.remote
def bench():
    from ray.serve.metrics import Counter, Histogram
    c = Counter("x_total", "d", tag_keys=("model",)); c.set_default_tags({"model": "m"})
    h = Histogram("y_seconds", "d", boundaries=[0.001*2**i for i in range(20)], tag_keys=("model",)); h.set_default_tags({"model": "m"})
    out = {}
    for name, f in (("counter.inc", lambda: c.inc(1)), ("hist.observe", lambda: h.observe(0.01))):
        for _ in range(1000): f()
        t = time.perf_counter(); n = 20000
        for _ in range(n): f()
        out[name] = (time.perf_counter() - t) / n * 1e6
    return out
print(ray.get(bench.remote()))
ray.shutdown()
