"""Shared fixtures: a tiny seeded random Llama (fast unit tests) and the real SmolLM2 (once)."""

from __future__ import annotations

import os

import pytest
import torch

# A replica-sized thread count keeps the suite steady on a 2-core CI machine.
torch.set_num_threads(int(os.environ.get("SPLITSERVE_TEST_THREADS", "2")))


def make_tiny_model(seed: int = 0, vocab_size: int = 49152, **overrides) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # wide weights give peaked logits, so greedy choices are not near-ties
        initializer_range=0.3,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.config._attn_implementation = "sdpa"
    return model


@pytest.fixture(scope="session")
def tiny_model() -> torch.nn.Module:
    return make_tiny_model()


@pytest.fixture(scope="session")
def smollm_config():
    from app.config import EngineConfig

    return EngineConfig()


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_config):
    from app.model_loader import load_tokenizer

    return load_tokenizer(smollm_config)


@pytest.fixture(scope="session")
def smollm_model(smollm_config):
    from app.model_loader import load_model

    return load_model(smollm_config)


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int,
              eos: int | None = None) -> list[int]:
    """The model's own generate(do_sample=False), one prompt in one process."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos if eos is not None else 0,
    )
    return out[0, len(prompt):].tolist()


async def engine_greedy(core, prompts: list[list[int]],
                        max_tokens: int) -> tuple[list[list[int]], int]:
    """The engine's greedy tokens for ``prompts`` sent together (prefilled as one batch,
    decoded in one loop, ``ignore_eos``) and the decode steps that took."""
    import asyncio

    from app.messages import PrefillRequest
    from app.sampling import SamplingParams

    reqs = [PrefillRequest(f"g{i}", tuple(p), SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for i, p in enumerate(prompts)]
    packages = core.make_prefiller().make_packages(reqs)
    loop = core.make_decode_loop(frozenset())

    async def tokens(pkg) -> list[int]:
        return [ev.token_id async for ev in loop.generate(pkg)]

    try:
        outs = list(await asyncio.gather(*(tokens(pkg) for pkg in packages)))
    finally:
        await loop.close()
    return outs, loop.decoder.steps
