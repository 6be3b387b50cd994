"""What holding the weights in fewer bytes costs in quality, against the float32 model.

For each variant (the engine's bf16 panels, its int8 panels with a scale per output and with
one per 32 and per 128 of k, for a GGUF model its own blocks in int8 panels, and
transformers' own bf16 model for comparison: what a bf16 server computes), over a fixed set
of prompts:

* greedy agreement: the variant's greedy continuation (``max_new`` tokens) against the
  float32 model's: how many prompts agree on every token, and the mean count of tokens
  before the first difference;
* teacher-forced: the float32 model's continuation fed to the variant: the mean absolute
  difference of the log-probability of each of its tokens, the mean difference (variant
  minus float32: negative means the variant likes float32's text less), and how often the
  variant's top token is float32's.

    python -m load_tests.weights_quality [--model smollm2-135m-instruct] [--max-new 32]
        [--int8-checkpoint DIR ...] [--json PATH]

``--int8-checkpoint`` (repeatable): also a compressed-tensors int8 checkpoint of the same
model (e.g. ``python -m load_tests.int8_checkpoint DIR [--group N]``), its own integers in
the engine's int8 panels.

Prints the machine's CPU model and flags with the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import replace
from pathlib import Path

import torch

from app.config import (
    DEFAULT_MODEL,
    KERNEL_ISA_ENV,
    EngineConfig,
    KernelConfig,
    cpu_flags,
    kernel_isa,
)
from app.fingerprint import model_dtype
from app.model_loader import load_model, load_tokenizer, resolve_model

PROMPTS = (
    "The capital of France is", "def fibonacci(n):", "List three primary colors:",
    "Water boils at", "The theory of relativity says that", "Once upon a time, in a small village,",
    "To make a cup of tea, first", "The largest planet in the solar system is",
    "import numpy as np\n", "Photosynthesis is the process by which",
    "The three laws of motion are", "In 1492, Christopher Columbus",
    "A good way to learn a new language is", "SELECT name FROM users WHERE",
    "The main ingredients of bread are", "Machine learning is",
)

VARIANTS = {
    "engine bf16 panels": {"dtype": "bfloat16"},
    "engine int8 panels": {"weights": "int8"},
    "engine int8 panels, a scale per 32 of k": {"weights": "int8-g32"},
    "engine int8 panels, a scale per 128 of k": {"weights": "int8-g128"},
    "transformers bf16": {"dtype": "bfloat16", "kernels": KernelConfig(linear="torch")},
}


def cpu_facts() -> str:
    """The CPU's model and its vector flags, as a line."""
    try:
        model = next((line.split(":", 1)[1].strip() for line in
                      Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor() or "unknown")
    except OSError:
        model = platform.processor() or "unknown"
    flags = sorted(f for f in cpu_flags() or () if f.startswith(("avx", "amx", "fma")))
    kept = f"; kernels kept to AVX2 ({KERNEL_ISA_ENV}=avx2)" if kernel_isa() == "avx2" else ""
    return f"{model}; {' '.join(flags)}{kept}"


@torch.inference_mode()
def greedy(model, ids: list[int], max_new: int) -> list[int]:
    mask = torch.ones(1, len(ids), dtype=torch.long)
    out = model.generate(torch.tensor([ids]), attention_mask=mask, max_new_tokens=max_new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@torch.inference_mode()
def logprobs(model, ids: list[int], cont: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``cont``'s tokens after ``ids`` (teacher-forced) and the top tokens."""
    seq = torch.tensor([ids + cont])
    logits = model(seq).logits[0, len(ids) - 1:-1].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(cont)[:, None])[:, 0], lp.argmax(dim=-1)


def measure(model_name: str, max_new: int, checkpoints: tuple[Path, ...] = ()) -> dict:
    base = EngineConfig(model=model_name)
    variants = dict(VARIANTS)
    if resolve_model(model_name).kind == "gguf":
        variants["engine int8 panels, the GGUF file's own blocks"] = {"weights": "gguf"}
    for checkpoint in checkpoints:
        variants[f"int8 checkpoint {checkpoint.name}"] = {"model": str(checkpoint)}
    tok = load_tokenizer(base)
    prompts = [tok.encode(p) for p in PROMPTS]
    ref = load_model(replace(base, kernels=KernelConfig(linear="torch")))
    conts = [greedy(ref, ids, max_new) for ids in prompts]
    ref_lp = [logprobs(ref, ids, c)[0] for ids, c in zip(prompts, conts, strict=True)]
    del ref
    results = {}
    for name, overrides in variants.items():
        model = load_model(replace(base, **overrides))
        same, before, diffs, top = 0, [], [], []
        for ids, cont, want in zip(prompts, conts, ref_lp, strict=True):
            got = greedy(model, ids, max_new)
            first = next((i for i, (a, b) in enumerate(zip(got, cont, strict=True)) if a != b),
                         max_new)
            same += first == max_new
            before.append(first)
            lp, argmax = logprobs(model, ids, cont)
            diffs.append(lp - want)
            top.append((argmax == torch.tensor(cont)).float().mean().item())
        d = torch.cat(diffs)
        results[name] = {
            "kind": model_dtype(model), "prompts": len(prompts), "max_new": max_new,
            "greedy_identical": same, "mean_tokens_before_difference": sum(before) / len(before),
            "mean_abs_logprob_diff": d.abs().mean().item(), "mean_logprob_diff": d.mean().item(),
            "top1_agreement": sum(top) / len(top)}
        del model
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--int8-checkpoint", type=Path, action="append", default=[],
                    help="a compressed-tensors int8 checkpoint of the model (repeatable)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    results = measure(args.model, args.max_new, tuple(args.int8_checkpoint))
    print(f"CPU: {cpu_facts()}")
    print(f"model {args.model}, {len(PROMPTS)} prompts, {args.max_new} greedy tokens each, "
          "against the float32 model")
    print(f"{'variant':<22} {'kind':<20} {'greedy same':>11} {'tokens before diff':>18} "
          f"{'mean |dlogp|':>12} {'mean dlogp':>10} {'top-1 agree':>11}")
    for name, r in results.items():
        print(f"{name:<22} {r['kind']:<20} {r['greedy_identical']:>6}/{r['prompts']:<4} "
              f"{r['mean_tokens_before_difference']:>18.1f} {r['mean_abs_logprob_diff']:>12.4f} "
              f"{r['mean_logprob_diff']:>10.4f} {r['top1_agreement']:>11.3f}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_facts(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
