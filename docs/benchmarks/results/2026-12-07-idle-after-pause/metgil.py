import time, ray, threading
ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
@ray.remote
def bench():
    from ray.serve.metrics import Counter
    c = Counter("x_total", "d", tag_keys=("model",)); c.set_default_tags({"model": "m"})
    out = {}
    stop = threading.Event()
    def spin():
        x = 0
        while not stop.is_set():
            x += 1
    for busy in (False, True):
        t0 = None
        if busy:
            th = threading.Thread(target=spin); th.start()
        n = 200
        t = time.perf_counter()
        for _ in range(n): c.inc(1)
        out[f"counter busy={busy} us"] = (time.perf_counter() - t) / n * 1e6
        t = time.perf_counter()
        for _ in range(n): sum(range(10))
        out[f"pure-python busy={busy} us"] = (time.perf_counter() - t) / n * 1e6
        if busy:
            stop.set(); th.join()
    return out
print(ray.get(bench.remote()))
ray.shutdown()
