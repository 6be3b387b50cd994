"""Continuous batching: exactness against generate(), joins/leaves, bounds, cancellation."""

from __future__ import annotations

import asyncio
import random

import pytest

from app.config import EngineConfig
from app.engine_core import EngineCore
from app.errors import QueueFullError
from app.messages import PrefillRequest
from app.sampling import SamplingParams
from tests.conftest import hf_greedy

EOS = 2


def _core(model, **cfg) -> EngineCore:
    return EngineCore(EngineConfig(**cfg), model=model)


def _prompts(n: int, seed: int = 1, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


async def _collect(loop, package) -> list[int]:
    return [ev.token_id async for ev in loop.generate(package)]


async def test_greedy_batch_matches_generate_with_staggered_joins(tiny_model):
    core = _core(tiny_model, max_batch_size=16)
    prefiller = core.make_prefiller()
    loop = core.make_decode_loop(frozenset())
    prompts = _prompts(8)
    max_tokens = [5 + 3 * i for i in range(8)]  # leave at different steps
    reqs = [
        PrefillRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=m, temperature=0.0))
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    packages = prefiller.make_packages(reqs)

    async def join_later(i):
        await asyncio.sleep(0.01 * i)  # join at different steps
        return await _collect(loop, packages[i])

    outs = await asyncio.gather(*(join_later(i) for i in range(8)))
    await loop.close()
    assert loop.decoder.steps > max(max_tokens) - 1  # they shared steps, not ran one by one
    for prompt, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out == hf_greedy(tiny_model, prompt, m)


async def test_decoder_bounded_by_batch_size_and_waits(tiny_model):
    core = _core(tiny_model, max_batch_size=2)
    loop = core.make_decode_loop(frozenset())
    prompts = _prompts(5, seed=3)
    packages = core.make_prefiller().make_packages(
        [PrefillRequest(f"b{i}", tuple(p), SamplingParams(max_tokens=6, temperature=0.0))
         for i, p in enumerate(prompts)]
    )
    max_running = 0

    async def watch():
        nonlocal max_running
        while True:
            max_running = max(max_running, len(loop.decoder.running))
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    outs = await asyncio.gather(*(_collect(loop, p) for p in packages))
    watcher.cancel()
    await loop.close()
    assert max_running == 2
    for p, out in zip(prompts, outs, strict=True):
        assert out == hf_greedy(tiny_model, p, 6)


async def test_kv_budget_limits_admissions(tiny_model):
    # 256 tokens of KV: two sequences of <=128 tokens fit, a third must wait
    core = _core(tiny_model, max_batch_size=8, max_kv_tokens=256)
    loop = core.make_decode_loop(frozenset())
    prompts = _prompts(4, seed=5, lo=10, hi=20)
    packages = core.make_prefiller().make_packages(
        [PrefillRequest(f"k{i}", tuple(p), SamplingParams(max_tokens=20, temperature=0.0))
         for i, p in enumerate(prompts)]
    )
    peak_reserved = 0

    async def watch():
        nonlocal peak_reserved
        while True:
            peak_reserved = max(peak_reserved, loop.decoder.stats().kv_tokens_reserved)
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    outs = await asyncio.gather(*(_collect(loop, p) for p in packages))
    watcher.cancel()
    await loop.close()
    assert 0 < peak_reserved <= 256
    assert all(len(o) == 20 for o in outs)


async def test_waiting_queue_full_raises(tiny_model):
    core = _core(tiny_model, max_batch_size=1, max_waiting=1)
    loop = core.make_decode_loop(frozenset())
    prompts = _prompts(3, seed=7)
    packages = core.make_prefiller().make_packages(
        [PrefillRequest(f"q{i}", tuple(p), SamplingParams(max_tokens=30, temperature=0.0))
         for i, p in enumerate(prompts)]
    )
    first = loop.generate(packages[0])
    await first.__anext__()  # pending: 1 waiting
    with pytest.raises(QueueFullError):
        await loop.generate(packages[1]).__anext__()
    await first.aclose()
    await loop.close()


async def test_cancel_frees_row_next_step(tiny_model):
    core = _core(tiny_model, max_batch_size=4)
    loop = core.make_decode_loop(frozenset())
    [a, b] = core.make_prefiller().make_packages(
        [PrefillRequest(f"c{i}", tuple(p), SamplingParams(max_tokens=200, temperature=0.0))
         for i, p in enumerate(_prompts(2, seed=9))]
    )
    gen_a = loop.generate(a)
    for _ in range(3):
        await gen_a.__anext__()
    task_b = asyncio.create_task(_collect(loop, b))
    while len(loop.decoder.running) < 2:
        await asyncio.sleep(0.001)
    # when the loop applies the cancel, in steps done: the engine thread keeps stepping while
    # this coroutine waits for its turn, so the count seen later says nothing
    applied: list[int] = []
    cancel = loop.decoder.cancel

    def recording_cancel(request_id):
        applied.append(loop.decoder.steps)
        return cancel(request_id)

    loop.decoder.cancel = recording_cancel
    steps_at_cancel = loop.decoder.steps
    await gen_a.aclose()
    while len(loop.decoder.running) == 2:
        await asyncio.sleep(0.001)
    # the step in flight when the client left may still carry the row; the next one not
    assert len(applied) == 1 and applied[0] <= steps_at_cancel + 1
    assert [s.request_id for s in loop.decoder.running] == ["c1"]
    out_b = await task_b
    await loop.close()
    assert out_b == hf_greedy(tiny_model, b.prompt_ids, 200)


async def test_eos_and_stop_token_ids_finish(tiny_model):
    core = _core(tiny_model)
    prompt = _prompts(1, seed=11)[0]
    ref = hf_greedy(tiny_model, prompt, 12)
    stop_tok = ref[4]
    loop = core.make_decode_loop(frozenset())
    [pkg] = core.make_prefiller().make_packages(
        [PrefillRequest("s", tuple(prompt),
                        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_tok,)))]
    )
    events = [ev async for ev in loop.generate(pkg)]
    await loop.close()
    cut = ref.index(stop_tok) + 1
    assert [e.token_id for e in events] == ref[:cut]
    assert events[-1].finish_reason == "stop"
    # the same token as EOS, unless ignore_eos
    loop2 = core.make_decode_loop(frozenset({stop_tok}))
    [pkg2] = core.make_prefiller().make_packages(
        [PrefillRequest("e", tuple(prompt),
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    )
    events2 = [ev async for ev in loop2.generate(pkg2)]
    await loop2.close()
    assert [e.token_id for e in events2] == ref
    assert events2[-1].finish_reason == "length"


async def test_seeded_sampling_independent_of_batch(tiny_model):
    core = _core(tiny_model)
    prompts = _prompts(4, seed=13)
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234)

    async def run(batch_prompts):
        loop = core.make_decode_loop(frozenset())
        pkgs = core.make_prefiller().make_packages(
            [PrefillRequest(f"x{i}", tuple(p), sp if i == 0 else sp.__class__(
                max_tokens=12, temperature=1.0, seed=i)) for i, p in enumerate(batch_prompts)]
        )
        outs = await asyncio.gather(*(_collect(loop, p) for p in pkgs))
        await loop.close()
        return outs[0]

    alone = await run(prompts[:1])
    crowded = await run(prompts)
    assert alone == crowded
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=99)
    loop = core.make_decode_loop(frozenset())
    [pkg] = core.make_prefiller().make_packages(
        [PrefillRequest("y", tuple(prompts[0]), other_seed)])
    different = await _collect(loop, pkg)
    await loop.close()
    assert different != alone


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_resumed_stream_continues_exactly(tiny_model, temperature):
    """Re-prefilling prompt + delivered tokens with output_offset continues the same stream
    (the ingress does this when a decode replica dies mid-stream)."""
    core = _core(tiny_model)
    prompt = _prompts(1, seed=21)[0]
    sp = SamplingParams(max_tokens=16, temperature=temperature, seed=77)
    loop = core.make_decode_loop(frozenset())
    [pkg] = core.make_prefiller().make_packages([PrefillRequest("full", tuple(prompt), sp)])
    full = [(e.index, e.token_id) async for e in loop.generate(pkg)]
    cut = 6
    sent = [t for _, t in full[:cut]]
    resumed_sp = SamplingParams(max_tokens=16 - cut, temperature=temperature, seed=77)
    [pkg2] = core.make_prefiller().make_packages(
        [PrefillRequest("resumed", tuple(prompt + sent), resumed_sp, output_offset=cut)])
    rest = [(e.index, e.token_id) async for e in loop.generate(pkg2)]
    await loop.close()
    assert [i for i, _ in full] == list(range(16))
    assert full[cut:] == rest


async def test_fail_streams_ends_open_streams_at_once(tiny_model):
    """A replica that finds itself wedged hands every open stream back with an error event,
    without waiting for the stuck step."""
    core = _core(tiny_model)
    loop = core.make_decode_loop(frozenset())
    [pkg] = core.make_prefiller().make_packages(
        [PrefillRequest("w", tuple(_prompts(1, seed=23)[0]),
                        SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))])
    gen = loop.generate(pkg)
    await gen.__anext__()
    with core.runner.lock:  # wedge: the next step cannot run
        await asyncio.sleep(0.05)
        assert loop.fail_streams("stalled") == 1
        events = []
        async for ev in gen:
            events.append(ev)
            if ev.error is not None:
                break
    assert events[-1].error == "stalled" and events[-1].finish_reason == "error"
    await loop.close()


async def test_first_decode_step_event_reports_queue_time(tiny_model):
    """Only a sequence's first decode-step token carries its wait to join the batch; with the
    batch full, the sequence that had to wait reports a longer wait than one that joined."""
    core = _core(tiny_model, max_batch_size=1)
    loop = core.make_decode_loop(frozenset())
    packages = core.make_prefiller().make_packages(
        [PrefillRequest(f"q{i}", tuple(p), SamplingParams(max_tokens=6, temperature=0.0))
         for i, p in enumerate(_prompts(2, seed=5))])

    async def events(pkg):
        return [ev async for ev in loop.generate(pkg)]

    first, second = await asyncio.gather(events(packages[0]), events(packages[1]))
    await loop.close()
    for evs in (first, second):
        queued = [ev.decode_queue_s for ev in evs]
        assert queued[0] is None  # the prefill's token
        assert queued[1] is not None and queued[1] >= 0
        assert all(q is None for q in queued[2:])
    # batch of one: the second sequence waited for the first to finish its 5 decode steps
    assert second[1].decode_queue_s > first[1].decode_queue_s


async def test_logprobs_of_a_greedy_run_are_the_models_log_softmax(tiny_model):
    """The first token's logprobs come from prefill (in the KV package), the rest from
    decode steps; all are the model's raw log-softmax at their positions."""
    import torch

    core = _core(tiny_model)
    prompt = _prompts(1, seed=31)[0]
    loop = core.make_decode_loop(frozenset())
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    [pkg] = core.make_prefiller().make_packages([PrefillRequest("lp", tuple(prompt), sp)])
    events = [ev async for ev in loop.generate(pkg)]
    await loop.close()
    out = [e.token_id for e in events]
    assert out == hf_greedy(tiny_model, prompt, 6)
    with torch.no_grad():
        logits = tiny_model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
    ref = torch.log_softmax(logits.float(), -1)
    for i, ev in enumerate(events):
        lp = ev.logprobs
        assert lp is not None and lp.token_id == out[i]
        assert lp.logprob == pytest.approx(ref[i, out[i]].item(), abs=1e-4)
        top = ref[i].topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    # n > 1: each answer's first token carries its own logprobs
    hot = SamplingParams(max_tokens=2, temperature=1.5, seed=3, logprobs=0)
    [multi] = core.make_prefiller().make_packages([PrefillRequest("m", tuple(prompt), hot, n=3)])
    for k in range(3):
        answer = multi.for_choice(k)
        assert answer.first_logprobs.token_id == answer.first_token
        assert answer.first_logprobs.logprob == pytest.approx(
            ref[0, answer.first_token].item(), abs=1e-4)
    # not asked for: none computed, none sent
    loop = core.make_decode_loop(frozenset())
    [plain] = core.make_prefiller().make_packages(
        [PrefillRequest("p", tuple(prompt), SamplingParams(max_tokens=3, temperature=0.0))])
    assert plain.first_logprobs is None
    assert [ev.logprobs async for ev in loop.generate(plain)] == [None] * 3
    await loop.close()


async def test_min_tokens_holds_eos_off_in_prefill_and_decode(tiny_model):
    core = _core(tiny_model)
    prompt = _prompts(1, seed=33)[0]
    ref = hf_greedy(tiny_model, prompt, 8)
    for eos_at in (0, 2):  # EOS is the first token (prefill's) or a decode step's
        eos = frozenset({ref[eos_at]})
        loop = core.make_decode_loop(eos)
        prefiller = core.make_prefiller(eos)
        early = SamplingParams(max_tokens=8, temperature=0.0)
        held = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=5)
        [a, b] = prefiller.make_packages([PrefillRequest("a", tuple(prompt), early),
                                          PrefillRequest("b", tuple(prompt), held)])
        stopped = [ev.token_id async for ev in loop.generate(a)]
        longer = [ev.token_id async for ev in loop.generate(b)]
        await loop.close()
        assert stopped == ref[:eos_at + 1]
        assert ref[eos_at] not in longer[:5] and len(longer) >= 5
        assert longer[:eos_at] == ref[:eos_at]
def test_one_decode_loop_serves_several_event_loops(tiny_model):
    """An engine driven from successive asyncio.run calls (scripts, tests): each run's loop
    task waits on an event of its own loop, and both runs decode the same tokens."""
    core = _core(tiny_model)
    prefiller = core.make_prefiller()
    loop = core.make_decode_loop(frozenset({EOS}))
    req = PrefillRequest("r", tuple(_prompts(1)[0]), SamplingParams(max_tokens=6,
                                                                      temperature=0.0))

    def run_once(rid: str) -> list[int]:
        [pkg] = prefiller.make_packages([PrefillRequest(rid, req.prompt_token_ids,
                                                        req.sampling)])
        return asyncio.run(_collect(loop, pkg))

    first = run_once("a")
    second = run_once("b")
    assert first == second and len(first) == 6
    # the second run's task ended waiting for work (cancelled with its loop), not failed
    assert loop._task is not None and loop._task.cancelled()
