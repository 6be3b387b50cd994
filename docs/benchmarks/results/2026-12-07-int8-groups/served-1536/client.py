import json, sys, time, statistics, urllib.request
url = sys.argv[1]; n = int(sys.argv[2]); out = int(sys.argv[3])
tpots = []
model = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
for i in range(n):
    body = json.dumps({"model": model, "prompt": "Tell me a story about a dragon number %d." % i,
                       "max_tokens": out, "ignore_eos": True, "stream": True, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter(); times = []
    with urllib.request.urlopen(req) as r:
        for line in r:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:])]
    tpots.append((times[-1] - times[0]) / (len(times) - 1) * 1000)
    print(f"req {i}: chunks {len(times)} ttft {1000*(times[0]-t0):.1f} ms tpot {tpots[-1]:.2f} ms "
          f"gap p50 {1000*statistics.median(gaps):.2f} min {1000*min(gaps):.2f}", flush=True)
print("TPOT median", statistics.median(tpots[1:]))
