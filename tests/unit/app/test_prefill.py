"""Prefill: batch planning, batched == one-by-one, request validation."""

from __future__ import annotations

import random

import pytest
import torch

from app.config import EngineConfig
from app.engine_core import EngineCore
from app.errors import ContextLengthError, InvalidRequestError
from app.messages import PrefillRequest
from app.prefill import plan_batches
from app.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def _req(rid: str, n: int, sampling: SamplingParams = GREEDY, start: int = 3) -> PrefillRequest:
    return PrefillRequest(rid, tuple(range(start, start + n)), sampling)


@pytest.mark.parametrize(("budget", "max_bs"), [(64, 8), (100, 3), (1000, 4), (7, 8), (1, 1)])
def test_plan_batches_respects_budget_and_size(budget, max_bs):
    rng = random.Random(budget * 31 + max_bs)
    reqs = [_req(f"r{i}", rng.randrange(1, 60)) for i in range(40)]
    batches = list(plan_batches(reqs, budget, max_bs))
    ids = [r.request_id for b in batches for r in b]
    assert sorted(ids) == sorted(r.request_id for r in reqs)  # every request exactly once
    assert len(ids) == len(set(ids))
    for b in batches:
        assert 1 <= len(b) <= max_bs
        padded = len(b) * max(r.num_tokens for r in b)
        assert padded <= budget or len(b) == 1  # only a lone over-long prompt may exceed


def test_plan_batches_packs_when_it_can():
    reqs = [_req(f"r{i}", 10) for i in range(8)]
    assert [len(b) for b in plan_batches(reqs, 40, 8)] == [4, 4]
    assert [len(b) for b in plan_batches(reqs, 1000, 3)] == [3, 3, 2]
    assert list(plan_batches([], 100, 4)) == []
    # a prompt longer than the budget runs alone, the others still batch
    mixed = [_req("long", 500), _req("a", 5), _req("b", 6)]
    batches = [[r.request_id for r in b] for b in plan_batches(mixed, 100, 8)]
    assert batches == [["a", "b"], ["long"]]


def test_batched_prefill_equals_one_by_one(tiny_model):
    core = EngineCore(EngineConfig(), model=tiny_model)
    prefiller = core.make_prefiller()
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 17, 9, 30, 1)]
    reqs = [PrefillRequest(f"p{i}", tuple(p), GREEDY) for i, p in enumerate(prompts)]

    batch_sizes: list[int] = []
    real_prefill = core.runner.forward_prefill

    def counting(batch):
        batch_sizes.append(len(batch))
        return real_prefill(batch)

    core.runner.forward_prefill = counting  # instance attribute: this core only
    batched = prefiller.make_packages(reqs)
    assert batch_sizes == [5]  # one padded forward pass for all of them
    assert [p.request_id for p in batched] == [r.request_id for r in reqs]  # order kept

    for req, pkg in zip(reqs, batched, strict=True):
        [alone] = prefiller.make_packages([req])
        assert pkg.first_token == alone.first_token
        assert pkg.prompt_ids == list(req.prompt_token_ids)
        assert pkg.seq_len == req.num_tokens
        assert torch.allclose(pkg.kv_tensor(), alone.kv_tensor(), atol=1e-5, rtol=0)
        with torch.no_grad():
            ref = tiny_model(torch.tensor([list(req.prompt_token_ids)])).logits[0, -1]
        assert pkg.first_token == int(ref.argmax())
    assert batch_sizes[1:] == [1] * len(reqs)


def test_prefill_kv_matches_model_cache(tiny_model):
    core = EngineCore(EngineConfig(), model=tiny_model)
    prompt = [5, 99, 1234, 7, 4242, 17, 8]
    [pkg] = core.make_prefiller().make_packages([PrefillRequest("k", tuple(prompt), GREEDY)])
    with torch.no_grad():
        out = tiny_model(torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    kv = pkg.kv_tensor()  # [layers, 2, kv_heads, seq, head_dim]
    assert kv.shape == (2, 2, 2, len(prompt), 16)
    for layer in range(2):
        keys, values = cache.layers[layer].keys[0], cache.layers[layer].values[0]
        assert torch.allclose(kv[layer, 0], keys, atol=1e-5, rtol=0)
        assert torch.allclose(kv[layer, 1], values, atol=1e-5, rtol=0)


def test_prefill_uses_bounded_batches(tiny_model):
    core = EngineCore(EngineConfig(prefill_token_budget=40, prefill_max_batch_size=2),
                      model=tiny_model)
    sizes: list[tuple[int, int]] = []
    real_prefill = core.runner.forward_prefill

    def recording(batch):
        sizes.append((len(batch), max(len(p) for p in batch)))
        return real_prefill(batch)

    core.runner.forward_prefill = recording
    reqs = [_req(f"b{i}", n) for i, n in enumerate((5, 12, 8, 20, 3, 15))]
    pkgs = core.make_prefiller().make_packages(reqs)
    assert [p.request_id for p in pkgs] == [r.request_id for r in reqs]
    assert sum(n for n, _ in sizes) == len(reqs)
    assert all(n <= 2 and n * longest <= 40 for n, longest in sizes)


def test_sampled_first_token_is_seeded(tiny_model):
    core = EngineCore(EngineConfig(), model=tiny_model)
    prefiller = core.make_prefiller()
    sp = SamplingParams(max_tokens=3, temperature=1.0, seed=77)
    a = prefiller.make_packages([_req("s1", 12, sp)])[0].first_token
    b = prefiller.make_packages(
        [_req("s2", 12, sp), _req("s3", 30, GREEDY, start=50)])[0].first_token
    assert a == b  # the batch a seeded request shares does not change its draw


def _prefiller(model, **cfg):
    return EngineCore(EngineConfig(**cfg), model=model).make_prefiller()


def test_validation_errors(tiny_model):
    prefiller = _prefiller(tiny_model, max_model_len=32)
    assert prefiller.runner.max_model_len == 32

    with pytest.raises(InvalidRequestError, match="empty") as info:
        prefiller.validate(PrefillRequest("e", (), GREEDY))
    assert info.value.param == "prompt"

    with pytest.raises(ContextLengthError, match="32 tokens") as info:
        prefiller.validate(_req("c", 32, SamplingParams(max_tokens=1, temperature=0.0)))
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "prompt"

    # prompt + max_tokens == context is fine; one more is not
    prefiller.validate(_req("ok", 31, SamplingParams(max_tokens=1, temperature=0.0)))
    prefiller.validate(_req("ok2", 20, SamplingParams(max_tokens=12, temperature=0.0)))
    with pytest.raises(ContextLengthError, match="at most 12") as info:
        prefiller.validate(_req("over", 20, SamplingParams(max_tokens=13, temperature=0.0)))
    assert info.value.param == "max_tokens"

    for bad in (-1, 49152, 10**6):
        with pytest.raises(InvalidRequestError, match="outside the vocabulary") as info:
            prefiller.validate(PrefillRequest("v", (5, bad, 7), GREEDY))
        assert info.value.param == "prompt"
    prefiller.validate(PrefillRequest("v0", (0, 49151), GREEDY))  # both ends are valid ids

    with pytest.raises(InvalidRequestError) as info:
        prefiller.validate(_req("st", 4, SamplingParams(stop_token_ids=(49152,), seed=1)))
    assert info.value.param == "stop_token_ids"


def test_invalid_request_fails_batch_before_compute(tiny_model):
    prefiller = _prefiller(tiny_model, max_model_len=32)
    calls = []
    real_prefill = prefiller.runner.forward_prefill
    prefiller.runner.forward_prefill = lambda batch: calls.append(batch) or real_prefill(batch)
    with pytest.raises(ContextLengthError):
        prefiller.make_packages([_req("good", 5), _req("bad", 40)])
    assert calls == []
