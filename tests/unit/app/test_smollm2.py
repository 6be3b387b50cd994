"""The real SmolLM2-135M-Instruct: the engine's greedy output equals the model's own generate()."""

from __future__ import annotations

import asyncio

import pytest

from app.config import EngineConfig
from app.engine_core import LocalEngine
from app.sampling import SamplingParams
from tests.conftest import hf_greedy

EOS = 2

QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about autumn leaves falling on a quiet pond.",
    "Explain in one sentence why the sky is blue during the day and red at sunset.",
    "List all eight planets of the solar system in order, starting from the one closest to "
    "the sun, separated by commas.",
    "Translate to French: 'The weather is nice today, so we will go for a walk in the park.'",
    "You are given a list of numbers: 4, 8, 15, 16, 23, 42. What is their sum? Think step by "
    "step, then give the final answer on its own line.",
]


def _engine(smollm_model, smollm_tokenizer) -> LocalEngine:
    config = EngineConfig()
    assert config.num_threads is None  # the suite's thread setting stays as conftest left it
    return LocalEngine(config, model=smollm_model, tokenizer=smollm_tokenizer)


def _check(out, prompt_ids, max_tokens, smollm_model, smollm_tokenizer):
    expected = hf_greedy(smollm_model, prompt_ids, max_tokens, eos=EOS)
    assert out.token_ids == expected
    assert 1 <= len(out.token_ids) <= max_tokens
    if out.token_ids[-1] == EOS:
        assert out.finish_reason == "stop"
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
    assert out.text == smollm_tokenizer.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.smollm
async def test_single_chat_request_matches_generate(smollm_model, smollm_tokenizer):
    engine = _engine(smollm_model, smollm_tokenizer)
    try:
        req = engine.make_request(SamplingParams(max_tokens=24, temperature=0.0),
                                  messages=[{"role": "user", "content": QUESTIONS[4]}])
        out = await engine.generate(req)
    finally:
        await engine.close()
    assert "<|im_start|>user" in smollm_tokenizer.decode(list(req.prompt_token_ids))
    assert out.prompt_token_ids == list(req.prompt_token_ids)
    assert len(out.token_ids) >= 8  # a real answer, not an immediate EOS
    assert "blue" in out.text.lower() or "scatter" in out.text.lower()
    _check(out, list(req.prompt_token_ids), 24, smollm_model, smollm_tokenizer)


@pytest.mark.smollm
async def test_concurrent_requests_match_generate(smollm_model, smollm_tokenizer):
    engine = _engine(smollm_model, smollm_tokenizer)
    max_tokens = [6 + 2 * i for i in range(len(QUESTIONS))]  # 6..20: leave at different steps
    reqs = [
        engine.make_request(SamplingParams(max_tokens=m, temperature=0.0),
                            messages=[{"role": "user", "content": q}])
        for q, m in zip(QUESTIONS, max_tokens, strict=True)
    ]
    lengths = [len(r.prompt_token_ids) for r in reqs]
    assert len(set(lengths)) == len(lengths)  # all prompt lengths differ
    try:
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
    finally:
        await engine.close()
    # they were decoded together: fewer steps than tokens decoded one sequence at a time
    decoded = sum(len(o.token_ids) - 1 for o in outs)  # the first token comes from prefill
    assert engine.decode_loop.decoder.steps < decoded
    for req, out, m in zip(reqs, outs, max_tokens, strict=True):
        assert out.request_id == req.request_id
        _check(out, list(req.prompt_token_ids), m, smollm_model, smollm_tokenizer)
