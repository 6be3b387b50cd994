"""Mixed batching: a decode step and prompt chunks in one forward pass
(``ModelRunner.forward_mixed``, ``Prefiller.plan_chunks``, ``Decoder.step(plan)``) compute
what the separate passes compute."""

from __future__ import annotations

import random

import pytest
import torch

from app import decode as decode_module
from app import model_runner
from app.config import EngineConfig
from app.decode import Decoder
from app.engine_core import EngineCore
from app.kv_cache import contiguous_tables
from app.messages import PrefillRequest
from app.sampling import SamplingParams
from app.sequence import Sequence
from tests.conftest import hf_greedy

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _core(model, **cfg) -> EngineCore:
    return EngineCore(EngineConfig(**cfg), model=model)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _decode_rows(runner, lengths: list[int]):
    """Block tables for decode rows of ``lengths`` tokens and two pools holding their KV
    alike (one for each way a test computes a step)."""
    tables = contiguous_tables(max(len(lengths), 1), 64, 16)[: len(lengths)]
    caches = [runner.make_kv_cache(16, 16) for _ in range(2)]
    if lengths:
        _, kvs = runner.forward_prefill([_ids(n, seed=n) for n in lengths])
        for cache in caches:
            for table, kv in zip(tables, kvs, strict=True):
                cache.write(table, kv)
    return tables, caches


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("decode_lengths", [[5, 20, 33], [7], []])
def test_mixed_forward_equals_prefill_and_decode_run_separately(tiny_model, decode_lengths,
                                                                 inplace, monkeypatch):
    """Decode rows' logits and pool writes, each chunk's last logits and KV: as ``decode`` and
    ``forward_prefill`` give them (a fresh chunk, a chunk after earlier positions); the
    decode rows reading the pool in place (the CPU kernel) or a gathered copy."""
    runner = _core(tiny_model).runner
    if inplace and not runner.inplace_attention:
        pytest.skip(f"in-place decode attention unavailable: {runner.inplace_reason}")
    runner.inplace_attention = inplace
    built = []
    real_build = model_runner.MixedStep.build
    monkeypatch.setattr(model_runner.MixedStep, "build",
                        lambda *a, **k: built.append(real_build(*a, **k)) or built[-1])
    rows = len(decode_lengths)
    tables, caches = _decode_rows(runner, decode_lengths)
    tokens = [11 + i for i in range(rows)]
    fresh = _ids(17, seed=1)
    doc = _ids(40, seed=2)
    _, [doc_past] = runner.forward_prefill([doc[:23]])

    ref_chunks = [runner.forward_prefill([fresh]), runner.forward_prefill([doc[23:]], [doc_past])]
    dec_logits, chunk_logits, chunk_kvs = runner.forward_mixed(
        caches[1], tables, tokens, decode_lengths, [fresh, doc[23:]], [None, doc_past])

    assert chunk_logits.shape[0] == 2 and dec_logits.shape[0] == rows
    assert rows == 0 or built[0].decode.inplace == inplace
    for i, (logits, [kv]) in enumerate(ref_chunks):
        torch.testing.assert_close(chunk_logits[i], logits[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(chunk_kvs[i], kv, rtol=1e-5, atol=1e-5)
        assert chunk_kvs[i].dtype == kv.dtype and chunk_kvs[i].is_contiguous()
    if rows:
        ref = runner.decode(caches[0], tables, tokens, decode_lengths)
        torch.testing.assert_close(dec_logits, ref, rtol=1e-4, atol=1e-4)
        for table, n in zip(tables, decode_lengths, strict=True):
            # the new token's key/value went into the row's next slot, as decode writes it
            torch.testing.assert_close(caches[1].read(table, n + 1), caches[0].read(table, n + 1),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("doc_first", [False, True])
@pytest.mark.parametrize("decode_lengths", [[9, 30], []])
def test_a_later_chunk_written_into_its_prompts_kv_equals_one_joined_to_a_copy(tiny_model,
                                                                               decode_lengths,
                                                                               doc_first):
    """``forward_mixed``'s ``into``: a prompt's later chunk written straight into its KV so
    far (after the ``past`` positions) attends over a view of it; the logits (decode rows'
    and the chunk's) are the same bits as with its past joined to a copy of the chunk, the
    chunk's KV lands in the buffer after the past, the past is untouched, and the chunk's
    KV comes back as the view of it."""
    runner = _core(tiny_model).runner
    rows = len(decode_lengths)
    tables, caches = _decode_rows(runner, decode_lengths)
    doc, fresh = _ids(50, seed=3), _ids(13, seed=4)
    _, [past] = runner.forward_prefill([doc[:21]])
    whole = torch.full((*past.shape[:3], 50, past.shape[4]), float("nan"))
    whole[:, :, :, :21] = past
    tokens = [4 + i for i in range(rows)]
    # beside a fresh prompt's chunk, before or after it
    order = [1, 0] if doc_first else [0, 1]
    chunks = [[fresh, doc[21:40]][i] for i in order]

    def run(cache, past_doc, into_doc):
        dec, logits, kvs = runner.forward_mixed(
            cache, tables, tokens, decode_lengths, chunks,
            [[None, past_doc][i] for i in order], [[None, into_doc][i] for i in order])
        return dec, logits, [kvs[order.index(i)] for i in (0, 1)]

    dec_a, chunk_a, [fresh_a, kv_a] = run(caches[0], past, None)
    dec_b, chunk_b, [fresh_b, kv_b] = run(caches[1], whole[:, :, :, :21], whole)
    assert torch.equal(chunk_a, chunk_b) and torch.equal(dec_a, dec_b)
    assert torch.equal(fresh_a, fresh_b) and fresh_b.is_contiguous()
    assert kv_b.data_ptr() == whole[:, :, :, 21:].data_ptr() and kv_b.shape[3] == 19
    assert torch.equal(whole[:, :, :, :21], past)
    assert torch.equal(whole[:, :, :, 21:40].to(kv_a.dtype), kv_a)
    assert torch.isnan(whole[:, :, :, 40:]).all()  # nothing written past the chunk
    for table, n in zip(tables, decode_lengths, strict=True):
        assert torch.equal(caches[1].read(table, n + 1), caches[0].read(table, n + 1))


def test_plan_chunks_fills_the_pass_budget_after_the_decode_rows(tiny_model):
    core = _core(tiny_model, prefill_chunk_tokens=32, prefill_token_budget=4096,
                 prefill_fairness_s=1e9, prefix_cache_mb=0)
    prefiller = core.make_prefiller()
    jobs = [prefiller.new_job(PrefillRequest(f"r{n}", tuple(_ids(n, n)), GREEDY))
            for n in (100, 10, 6)]
    plan = prefiller.plan_chunks(jobs, decode_rows=8)
    # shortest remaining first, 32 - 8 decode rows = 24 tokens of chunks, not padded
    assert [j.req.num_tokens for j in plan.rows] == [6, 10, 100]
    assert plan.sizes == [6, 10, 8] and plan.tokens == 24
    assert plan.before == [6, 10, 100]
    # a prompt of several chunks is written in place from its first (its KV made whole now);
    # a prompt that is one chunk keeps the chunk's own KV
    chunks, past, into = plan.inputs()
    assert plan.in_place == [False, False, True] and into[:2] == [None, None]
    assert into[2] is jobs[0].whole and into[2].shape[3] == 100 and past[2].shape[3] == 0
    assert [len(c) for c in chunks] == [6, 10, 8] and past[:2] == [None, None]
    # a full decode batch leaves the chunks a quarter of the pass, never nothing
    assert prefiller.plan_chunks(jobs, decode_rows=64).tokens == 8
    # each row computes at most prefill_chunk_tokens
    assert prefiller.plan_chunks(jobs[:1], decode_rows=0).sizes == [32]
    assert prefiller.plan_chunks([], decode_rows=1) is None


def test_a_prompt_computed_in_mixed_steps_gets_the_package_it_gets_alone(tiny_model):
    """Chunks riding in decode steps: the package (KV, first token, first-token logprobs)
    of prefilling it alone, and the running sequence's tokens those of generating alone."""
    core = _core(tiny_model, prefill_chunk_tokens=16, prefix_cache_mb=0)
    prefiller = core.make_prefiller()
    decoder = Decoder(core.runner, eos_token_ids=frozenset(), max_batch_size=4,
                      max_kv_tokens=4096)
    prompt = _ids(20, seed=5)
    [pkg] = prefiller.make_packages([PrefillRequest("s", tuple(prompt), GREEDY)])
    seq = Sequence("s", pkg.prompt_ids, pkg.sampling)
    seq.append(pkg.first_token, eos_token_ids=frozenset(), max_model_len=512)
    decoder.add(seq, pkg)

    doc = _ids(45, seed=6)
    sampling = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3)
    [alone] = prefiller.make_packages([PrefillRequest("alone", tuple(doc), sampling)])
    job = prefiller.new_job(PrefillRequest("doc", tuple(doc), sampling))
    packages, in_place = [], []
    while job.remaining:
        plan = prefiller.plan_chunks([job], decode_rows=len(decoder.running) or 1)
        decoder.step(plan)
        packages += plan.packages
        in_place += plan.in_place
    # 16-token passes, one decode row: chunks of 15 + 15 + 15, each in a decode step, each
    # written straight into the prompt's KV (held in the runner's dtype, made at the first)
    assert decoder.mixed_steps == 3 and decoder.steps == 3
    assert in_place == [True, True, True] and job.in_whole == 45 and job.parts == []
    assert job.whole.dtype == core.runner.dtype
    [mixed] = [p for p in packages if p is not None]
    assert mixed.first_token == alone.first_token
    a, b = mixed.first_logprobs, alone.first_logprobs
    assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
    assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    torch.testing.assert_close(mixed.kv_tensor(), alone.kv_tensor(), rtol=1e-5, atol=1e-5)
    assert seq.output_token_ids == hf_greedy(tiny_model, prompt, len(seq.output_token_ids))


def test_decode_threads_take_decode_only_steps_and_leave_mixed_ones(tiny_model, monkeypatch):
    """``decode_threads``: a step that carries no prompt chunk runs on that many threads (its
    sampling too), a step carrying chunks on the engine's own, and the count is back after
    each."""
    core = _core(tiny_model, prefill_chunk_tokens=16, prefix_cache_mb=0, num_threads=2,
                 decode_threads=1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        decoder = core.make_decode_loop(frozenset()).decoder
        seen = []
        runner = decoder.runner
        decode, mixed = runner.decode, runner.forward_mixed

        def record(fn, kind):
            def call(*args, **kwargs):
                seen.append((kind, torch.get_num_threads()))
                return fn(*args, **kwargs)
            return call
        runner.decode = record(decode, "decode")
        runner.forward_mixed = record(mixed, "mixed")
        monkeypatch.setattr(decode_module, "sample_tokens",
                            record(decode_module.sample_tokens, "sample"))
        prefiller = core.make_prefiller()
        prompt = _ids(20, seed=5)
        [pkg] = prefiller.make_packages([PrefillRequest("s", tuple(prompt), GREEDY)])
        seq = Sequence("s", pkg.prompt_ids, pkg.sampling)
        seq.append(pkg.first_token, eos_token_ids=frozenset(), max_model_len=512)
        decoder.add(seq, pkg)
        decoder.step()
        job = prefiller.new_job(PrefillRequest("doc", tuple(_ids(20, seed=6)), GREEDY))
        decoder.step(prefiller.plan_chunks([job], decode_rows=1))
        decoder.step()
        assert seen == [("decode", 1), ("sample", 1), ("mixed", 2), ("sample", 2),
                        ("decode", 1), ("sample", 1)]
        assert torch.get_num_threads() == 2
        assert seq.output_token_ids == hf_greedy(tiny_model, prompt, len(seq.output_token_ids))
    finally:
        torch.set_num_threads(before)
