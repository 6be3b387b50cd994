"""What int8 weights with a scale per group of k (and an offset) would cost in quality, before
any kernel holds them: the default model's linear weights quantized and dequantized in place
(torch's modules, float32), measured as load_tests/weights_quality.py measures a variant
(16 prompts, 32 greedy tokens, teacher-forced log-probs against the float32 model). The
tied embedding is quantized with the head here, where the engine keeps it float32: per
channel gives the engine's own int8 figure all the same (mean |dlogp| 0.0486 against 0.0485).

    .venv/bin/python docs/benchmarks/results/2026-12-07-int8-groups/fake_quant.py
"""
from dataclasses import replace

import torch

from app.config import EngineConfig, KernelConfig
from app.model_loader import load_model, load_tokenizer
from load_tests.weights_quality import PROMPTS, cpu_facts, greedy, logprobs

# (group of k or None for one per output channel, asymmetric: an offset per group too)
SCHEMES = [(None, False), (None, True), (192, False), (64, False), (32, False), (32, True)]


def fake_quant(w: torch.Tensor, group: int | None, asym: bool) -> torch.Tensor:
    out, k = w.shape
    g = w.reshape(out, k // (group or k), group or k)
    if asym:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        s = ((hi - lo) / 255).clamp(min=1e-12)
        return (torch.round((g - lo) / s).clamp(0, 255) * s + lo).reshape(out, k)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return (torch.round(g / s).clamp(-127, 127) * s).reshape(out, k)


@torch.inference_mode()
def main() -> None:
    base = replace(EngineConfig(), kernels=KernelConfig(linear="torch"))
    tok = load_tokenizer(base)
    prompts = [tok.encode(p) for p in PROMPTS]
    model = load_model(base)
    conts = [greedy(model, ids, 32) for ids in prompts]
    ref = [logprobs(model, ids, c)[0] for ids, c in zip(prompts, conts, strict=True)]
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    orig = {n: m.weight.detach().clone() for n, m in linears.items()}
    print(f"CPU: {cpu_facts()}")
    print("scheme                     greedy same  tokens before diff  mean |dlogp|  top-1 agree")
    for group, asym in SCHEMES:
        for n, m in linears.items():
            m.weight.copy_(fake_quant(orig[n], group, asym))
        same, before, diffs, top = 0, [], [], []
        for ids, cont, want in zip(prompts, conts, ref, strict=True):
            got = greedy(model, ids, 32)
            first = next((i for i, (a, b) in enumerate(zip(got, cont)) if a != b), 32)
            same += first == 32
            before.append(first)
            lp, top1 = logprobs(model, ids, cont)
            diffs.append(lp - want)
            top.append((top1 == torch.tensor(cont)).float().mean().item())
        d = torch.cat(diffs)
        name = (f"per {group} of k" if group else "per channel") + (", offset" if asym else "")
        print(f"{name:<26} {same:>6}/{len(prompts):<5} {sum(before) / len(before):>18.1f}"
              f"  {d.abs().mean().item():>12.4f}  {sum(top) / len(top):>11.3f}")


if __name__ == "__main__":
    main()
