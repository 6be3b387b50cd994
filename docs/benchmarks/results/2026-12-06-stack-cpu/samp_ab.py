import sys, time, statistics, torch
torch.set_num_threads(int(sys.argv[1]))
from app.sampling import SamplingParams, sample_tokens
def old(logits, params):
    logits = logits.float()
    idx = torch.tensor(list(range(len(params))))
    return logits.index_select(0, idx).argmax(dim=-1).tolist()
for b in (1, 8):
    l = torch.randn(b, 49152); ps = [SamplingParams(max_tokens=10, temperature=0.0)] * b; st = [3] * b
    assert sample_tokens(l, ps, st) == old(l, ps)
    res = {"old": [], "new": []}
    for r in range(7):
        for name, fn in (("old", lambda: old(l, ps)), ("new", lambda: sample_tokens(l, ps, st))):
            t = time.perf_counter()
            for _ in range(500): fn()
            res[name].append((time.perf_counter() - t) / 500 * 1e6)
    print(f"threads {sys.argv[1]} batch {b}: old-style {statistics.median(res['old']):.1f} us, sample_tokens now {statistics.median(res['new']):.1f} us")
