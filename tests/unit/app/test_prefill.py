"""Prefill: pass planning (budget, chunks, shortest first, fairness), chunked == whole,
batched == one-by-one, request validation."""

from __future__ import annotations

import random

import pytest
import torch

from app.config import EngineConfig
from app.engine_core import EngineCore
from app.errors import ContextLengthError, InvalidRequestError
from app.messages import PrefillRequest
from app.prefill_policy import MAX_PADDING
from app.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def _req(rid: str, n: int, sampling: SamplingParams = GREEDY, start: int = 3) -> PrefillRequest:
    return PrefillRequest(rid, tuple(range(start, start + n)), sampling)


def _jobs(prefiller, lengths, start_at=0.0):
    jobs = [prefiller.new_job(_req(f"j{i}", n)) for i, n in enumerate(lengths)]
    for i, job in enumerate(jobs):
        job.arrived = start_at + i * 1e-3
    return jobs


@pytest.mark.parametrize(("budget", "max_bs", "chunk"),
                         [(64, 8, 16), (100, 3, 64), (1000, 4, 256), (7, 8, 4), (1, 1, 1)])
def test_plan_pass_respects_budget_rows_and_padding(tiny_model, budget, max_bs, chunk):
    prefiller = _prefiller(tiny_model, prefill_token_budget=budget, prefill_max_batch_size=max_bs,
                           prefill_chunk_tokens=chunk, prefill_fairness_s=1e9)
    rng = random.Random(budget * 31 + max_bs)
    jobs = _jobs(prefiller, [rng.randrange(1, 120) for _ in range(30)])
    passes = 0
    while any(j.remaining for j in jobs):
        rows = prefiller.plan_pass(jobs, now=0.0)
        chunks = [prefiller.chunk_of(j) for j in rows]
        assert 1 <= len(rows) <= max_bs and max(chunks) <= chunk
        padded = len(rows) * max(chunks)
        assert padded <= min(budget, chunk) or len(rows) == 1  # a lone chunk may exceed
        assert padded - sum(chunks) <= max(MAX_PADDING * sum(chunks), 0) or len(rows) == 1
        for job, n in zip(rows, chunks, strict=True):  # stand-in for run_pass
            job.done += n
        passes += 1
    assert passes <= sum(-(-j.req.num_tokens // chunk) for j in jobs)


def test_short_prompt_goes_before_a_long_prompts_next_chunk(tiny_model):
    prefiller = _prefiller(tiny_model, prefill_chunk_tokens=32, prefill_fairness_s=1e9)
    [doc] = _jobs(prefiller, [200])
    assert prefiller.plan_pass([doc], now=0.0) == [doc]
    doc.done += 32  # its first chunk ran; a chat arrives
    chat = prefiller.new_job(_req("chat", 10))
    assert prefiller.plan_pass([doc, chat], now=0.1) == [chat]  # 32 would pad 10 too much
    chat.done = 10
    assert prefiller.plan_pass([doc, chat], now=0.2) == [doc]


def test_a_pass_takes_no_more_prompts_once_it_holds_prefill_batch_tokens(tiny_model):
    """A wave of chats: without prefill_batch_tokens they share passes up to the chunk;
    with it each pass stops taking prompts once it holds that many tokens (the one that
    crosses it still joins), so the first chats finish after a fraction of the wave."""
    def passes(**cfg):
        prefiller = _prefiller(tiny_model, prefill_chunk_tokens=256, prefill_fairness_s=1e9,
                               **cfg)
        jobs = _jobs(prefiller, [64, 64, 64, 64, 16, 16, 16, 300])
        sizes = []
        while any(j.remaining for j in jobs):
            rows = prefiller.plan_pass(jobs, now=0.0)
            sizes.append(sorted(prefiller.chunk_of(j) for j in rows))
            for job in rows:
                job.done += prefiller.chunk_of(job)
        return sizes

    assert passes() == [[16, 16, 16], [64, 64, 64, 64], [256], [44]]
    assert passes(prefill_batch_tokens=64) == [[16, 16, 16], [64], [64], [64], [64], [256],
                                               [44]]
    assert passes(prefill_batch_tokens=100) == [[16, 16, 16], [64, 64], [64, 64], [256], [44]]
    with pytest.raises(ValueError, match="prefill_batch_tokens"):
        EngineConfig(prefill_batch_tokens=0)


def test_a_prompt_that_waited_leads_every_other_pass(tiny_model):
    prefiller = _prefiller(tiny_model, prefill_chunk_tokens=32, prefill_fairness_s=2.0,
                           prefill_max_batch_size=1)
    [doc] = _jobs(prefiller, [200], start_at=0.0)
    leaders = []
    for t in range(8):  # a fresh short prompt arrives before every pass
        chat = prefiller.new_job(_req(f"c{t}", 10))
        chat.arrived = 3.0 + t
        rows = prefiller.plan_pass([doc, chat], now=3.0 + t)
        leaders.append("doc" if rows[0] is doc else "chat")
        rows[0].done += prefiller.chunk_of(rows[0])
    assert leaders == ["doc", "chat"] * 4


def test_chunked_prefill_equals_one_pass(tiny_model):
    prompts = [list(range(3, 3 + n)) for n in (45, 7, 33)]
    reqs = [PrefillRequest(f"c{i}", tuple(p), GREEDY) for i, p in enumerate(prompts)]
    whole = _prefiller(tiny_model, prefix_cache_mb=0).make_packages(reqs)
    chunked_prefiller = _prefiller(tiny_model, prefill_chunk_tokens=8, prefix_cache_mb=0)
    calls = []
    real = chunked_prefiller.runner.prefill_layers
    chunked_prefiller.runner.prefill_layers = (
        lambda batch, *rest: calls.append(max(map(len, batch))) or real(batch, *rest))
    chunked = chunked_prefiller.make_packages(reqs)
    assert max(calls) == 8 and len(calls) >= 45 // 8  # the long prompts took several passes
    for a, b in zip(whole, chunked, strict=True):
        assert a.first_token == b.first_token
        torch.testing.assert_close(a.kv_tensor(), b.kv_tensor(), atol=1e-5, rtol=0)


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
    real_prefill = core.runner.prefill_layers

    def recording(batch, *rest):
        sizes.append((len(batch), max(len(p) for p in batch)))
        return real_prefill(batch, *rest)

    core.runner.prefill_layers = recording
    reqs = [_req(f"b{i}", n) for i, n in enumerate((15, 12, 16, 20, 13, 15))]
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
    real_prefill = prefiller.runner.prefill_layers
    prefiller.runner.prefill_layers = (
        lambda batch, *rest: calls.append(batch) or real_prefill(batch, *rest))
    with pytest.raises(ContextLengthError):
        prefiller.make_packages([_req("good", 5), _req("bad", 40)])
    assert calls == []


def test_n_answers_get_one_prefill_and_a_first_token_each(tiny_model):
    """n = 4: one pass, a first token per answer (answer k drawn with seed + k, as a request
    of its own with that seed would draw it), the KV shared by every answer."""
    prefiller = _prefiller(tiny_model, prefix_cache_mb=0)
    sampled = SamplingParams(max_tokens=4, temperature=1.5, seed=11)
    prompt = tuple(range(40, 61))
    calls = []
    real = prefiller.runner.prefill_layers
    prefiller.runner.prefill_layers = (
        lambda batch, *rest: calls.append(len(batch)) or real(batch, *rest))
    [pkg] = prefiller.make_packages([PrefillRequest("m", prompt, sampled, n=4)])
    assert calls == [1] and len(pkg.choice_first_tokens) == 4
    for k in range(4):
        alone = prefiller.make_packages(
            [PrefillRequest(f"a{k}", prompt, sampled.for_choice(k))])[0]
        answer = pkg.for_choice(k)
        assert answer.first_token == alone.first_token == pkg.choice_first_tokens[k]
        assert answer.sampling.seed == 11 + k and answer.request_id == f"m/{k}"
        assert answer.kv is pkg.kv  # one object in the store, read by every answer
    assert len(set(pkg.choice_first_tokens)) > 1  # hot sampling: the answers differ
    [greedy] = prefiller.make_packages([PrefillRequest("g", prompt, GREEDY, n=2)])
    assert len(set(greedy.choice_first_tokens)) == 1
    with pytest.raises(ValueError, match="one answer"):
        prefiller.make_packages([PrefillRequest("one", prompt, GREEDY)])[0].for_choice(1)


def test_a_jobs_kv_is_copied_once_into_one_tensor_as_its_parts_arrive():
    """A prompt's KV in parts (a cached prefix, chunks): each part is copied once into one
    tensor of the prompt's length, which ``kv()`` views; the done prompt's KV is that
    tensor whole (no concatenation of every earlier part on every pass)."""
    from app.prefill import PrefillJob

    job = PrefillJob(_req("w", 10))
    assert job.kv() is None
    a, b, c = (torch.randn(2, 2, 2, n, 4) for n in (3, 4, 3))
    job.parts.append(a)
    job.done = 3
    assert job.kv() is a  # one part: itself
    job.parts.append(b)
    job.done = 7
    kv = job.kv()
    assert torch.equal(kv, torch.cat([a, b], 3))
    whole = job.whole
    assert whole is not None and whole.shape[3] == 10 and kv.data_ptr() == whole.data_ptr()
    job.parts.append(c)
    job.done = 10
    kv = job.kv()
    assert job.whole is whole and kv.is_contiguous() and kv.data_ptr() == whole.data_ptr()
    assert torch.equal(kv, torch.cat([a, b, c], 3))


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16"])
def test_a_prompt_alone_in_its_pass_writes_each_chunk_into_its_kv_in_place(tiny_model,
                                                                           kv_dtype):
    """A long prompt's chunks, alone in their passes, write their keys/values straight into
    the job's KV (held in the runner's dtype, made for the whole prompt at its first chunk)
    and attend over a view of it: no past + chunk concatenation a layer, no copy of a chunk
    afterwards. The package is in the KV dtype and equals one pass over the whole prompt."""
    req = PrefillRequest("long", tuple(random.Random(5).randrange(3, 200) for _ in range(45)),
                         GREEDY)
    [want] = _prefiller(tiny_model, prefix_cache_mb=0, kv_dtype=kv_dtype).make_packages([req])
    prefiller = _prefiller(tiny_model, prefill_chunk_tokens=8, prefix_cache_mb=0,
                           kv_dtype=kv_dtype)
    assert prefiller.work_dtype == prefiller.runner.dtype == torch.float32
    job = prefiller.new_job(req)
    intos, real = [], prefiller.runner.prefill_layers
    prefiller.runner.prefill_layers = (
        lambda batch, past=None, into=None: intos.append(into) or real(batch, past, into))
    packages = [None]
    while packages[0] is None:
        packages = prefiller.run_pass([job])
        assert job.parts == [] and job.in_whole == job.done
    assert len(intos) == 6 and all(into is intos[0] for into in intos)
    assert intos[0].dtype == torch.float32 and job.in_whole == 45
    # cast to bf16, the package is a copy: the KV so far goes back to the prefiller's spares
    assert (job.whole is None) == (kv_dtype == "bfloat16")
    got = packages[0]
    assert got.first_token == want.first_token
    assert got.kv_tensor().dtype == want.kv_tensor().dtype == prefiller.runner.kv_dtype
    # bf16 KV: the chunks attend over their past rounded to bf16, one pass over float32
    # keys/values, so a value may land one bf16 step (2^-8 of it) either side
    torch.testing.assert_close(got.kv_tensor().float(), want.kv_tensor().float(),
                               atol=1e-5 if kv_dtype is None else 1e-2,
                               rtol=0 if kv_dtype is None else 2 ** -6)


def test_one_rows_past_is_its_own_kv_not_a_padded_copy():
    from app.kv_package import KVLayout
    from app.prefill_inputs import padded_past

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, kv_dtype="float32")
    kv = torch.randn(2, 2, 2, 5, 4)
    [(k0, v0), (k1, v1)] = padded_past([kv], [5], layout, torch.float32, torch.device("cpu"),
                                       [torch.device("cpu")] * 2)
    assert k1.data_ptr() == kv[1, 0].data_ptr() and v0.data_ptr() == kv[0, 1].data_ptr()
    assert torch.equal(k0[0], kv[0, 0]) and torch.equal(v1[0], kv[1, 1])
    # two rows of different pasts: zero-padded to the longer
    [(k, _), _] = padded_past([kv, kv[:, :, :, :2]], [5, 2], layout, torch.float32,
                              torch.device("cpu"), [torch.device("cpu")] * 2)
    assert k.shape == (2, 2, 5, 4) and torch.equal(k[1, :, 2:], torch.zeros(2, 3, 4))
