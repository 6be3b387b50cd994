"""Device diagnostics: the logit margin where prompt 3 diverged, and where a decode step's time goes."""
import sys, time, random
import torch
from app.config import EngineConfig
from app.engine_core import EngineCore
from app.kv_cache import DEFAULT_BLOCK_SIZE, contiguous_tables
from load_tests.gpu_check import CHAT_PROMPTS, load_greedy_inputs, check_greedy

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
dt = "bfloat16" if dev == "cuda" else "float32"
cfg = EngineConfig(device=dev, dtype=dt, max_kv_tokens=65536)
model, prompts, eos = load_greedy_inputs(cfg, CHAT_PROMPTS)
core = EngineCore(cfg, model=model)
runner = core.runner
sync = (lambda: torch.cuda.synchronize()) if dev == "cuda" else (lambda: None)
with torch.inference_mode():
    res = []
    for i, g in enumerate(res):
        if g.alone == g.expected:
            continue
        at = next((j for j, (a, b) in enumerate(zip(g.alone, g.expected)) if a != b),
                  min(len(g.alone), len(g.expected)))
        ctx = prompts[i] + g.expected[:at]
        ids = torch.tensor([ctx], device=runner.device)
        for name, m in (("bf16 full forward", model),):
            lg = m(ids).logits[0, -1].float()
            top = torch.topk(lg, 5)
            print(f"prompt {i} at {at} {name}: top5 {top.indices.tolist()} {[round(v, 3) for v in top.values.tolist()]}; "
                  f"engine {g.alone[at]}={lg[g.alone[at]].item():.3f} generate {g.expected[at]}={lg[g.expected[at]].item():.3f}")
        m32 = model.float()
        lg = m32(ids).logits[0, -1]
        top = torch.topk(lg, 5)
        print(f"prompt {i} at {at} fp32 full forward: top5 {top.indices.tolist()} {[round(v, 3) for v in top.values.tolist()]}; "
              f"engine {g.alone[at]}={lg[g.alone[at]].item():.3f} generate {g.expected[at]}={lg[g.expected[at]].item():.3f}")
        model.to(torch.bfloat16 if dt == "bfloat16" else torch.float32)
    # decode step, batch 1 and 8, 512 context: the engine's step, then the model's own cached step
    rng = random.Random(0)
    plen = 512
    p = [rng.randrange(3, runner.vocab_size) for _ in range(plen)]
    _, [kv] = runner.forward_prefill([p])
    for bsz in (1, 8):
        tables = contiguous_tables(bsz, plen + 80, DEFAULT_BLOCK_SIZE)
        cache = runner.make_kv_cache(bsz * len(tables[0]), DEFAULT_BLOCK_SIZE)
        for t in tables:
            cache.write(t, kv)
        st = {"tok": [p[-1]] * bsz, "pos": plen}
        def step():
            lg = runner.decode(cache, tables, st["tok"], [st["pos"]] * bsz)
            st["tok"] = lg.argmax(-1).tolist(); st["pos"] += 1
        for _ in range(3): step()
        sync(); t0 = time.perf_counter()
        for _ in range(20): step()
        sync(); eng = (time.perf_counter() - t0) / 20 * 1000
        # the model's own step with its DynamicCache
        ids = torch.tensor([p] * bsz, device=runner.device)
        out = model(ids, use_cache=True)
        pkv = out.past_key_values; nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for k in range(23):
            if k == 3: sync(); t0 = time.perf_counter()
            o = model(nxt, past_key_values=pkv, use_cache=True)
            pkv = o.past_key_values; nxt = o.logits[:, -1].argmax(-1, keepdim=True)
        sync(); hf = (time.perf_counter() - t0) / 20 * 1000
        print(f"batch {bsz}: engine decode step {eng:.2f} ms, model's own cached step {hf:.2f} ms")
        if bsz == 1:
            from torch.profiler import profile, ProfilerActivity
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
            with profile(activities=acts) as prof:
                for _ in range(5): step()
                sync()
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))
