"""Build a model neither this app nor a peer was tuned for, as a plain Hugging Face folder:
an architecture's config (default: Qwen2-0.5B's shape: 24 layers, hidden 896, 14 query
heads over 2 KV heads, q/k/v biases, tied embeddings), random weights, and the default
model's tokenizer (its vocabulary sets the embedding's size), saved in bf16 as checkpoints
usually are. For side-by-side runs where only speed matters (``--ignore-eos``): random
weights answer nonsense.

    python -m load_tests.make_model OUT_DIR [--arch qwen2-0.5b] [--dtype bfloat16] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from app.config import EngineConfig, parse_dtype
from app.model_loader import load_tokenizer

SHAPES = {
    "qwen2-0.5b": ("Qwen2Config", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "llama-tiny-1b": ("LlamaConfig", dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
}


def build(out: Path, arch: str, dtype: str, seed: int) -> int:
    """Writes the folder; returns the parameter count."""
    import transformers
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(EngineConfig())
    kind, shape = SHAPES[arch]
    config = getattr(transformers, kind)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=parse_dtype(dtype)).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", choices=sorted(SHAPES), default="qwen2-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    count = build(args.out, args.arch, args.dtype, args.seed)
    print(f"{args.arch}: {count / 1e6:.0f}M parameters ({args.dtype}) in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
