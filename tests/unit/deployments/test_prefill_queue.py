"""The prefill replica's queue: prompts computed pass after pass, counts kept, and a
failure ends the callers' waits with the error instead of leaving them hanging."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest

from app.config import EngineConfig
from app.engine_core import EngineCore
from app.messages import PrefillRequest
from app.prefill_queue import PrefillQueue
from app.sampling import SamplingParams
from deployments.metrics import PrefillMetrics

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def _queue(model, lanes: int = 1, **cfg) -> PrefillQueue:
    return PrefillQueue(EngineCore(EngineConfig(**cfg), model=model), 0.0, PrefillMetrics("tiny"),
                        lanes=lanes)


def _req(rid: str, n: int) -> PrefillRequest:
    return PrefillRequest(rid, tuple(range(10, 10 + n)), GREEDY)


async def test_prompts_are_computed_in_chunked_passes_and_counted(tiny_model):
    queue = _queue(tiny_model, prefill_chunk_tokens=16, prefix_cache_mb=0)
    alone = queue.prefiller.make_packages([_req("ref", 40)])[0]
    long_pkg, short_pkg = await asyncio.gather(queue.enqueue(_req("doc", 40)),
                                               queue.enqueue(_req("chat", 6)))
    assert long_pkg.first_token == alone.first_token and long_pkg.seq_len == 40
    assert short_pkg.seq_len == 6
    assert queue.passes >= 3  # 40 tokens in chunks of 16
    assert queue.tokens_total == 46 and queue.requests_total == 2
    assert queue.waiting_tokens == 0 and queue.waiting_requests == 0 and queue.jobs == []


async def test_a_failing_pass_or_plan_fails_the_callers_and_the_queue_goes_on(tiny_model):
    queue = _queue(tiny_model, prefix_cache_mb=0)
    real_run, real_plan = queue.prefiller.advance, queue.prefiller.plan_pass

    def broken_run(run, layers=None):
        raise RuntimeError("pass broke")

    queue.prefiller.advance = broken_run
    with pytest.raises(RuntimeError, match="pass broke"):
        await asyncio.wait_for(queue.enqueue(_req("a", 8)), 60)
    queue.prefiller.advance = real_run

    def broken_plan(jobs, now=None):
        raise RuntimeError("plan broke")

    queue.prefiller.plan_pass = broken_plan
    with pytest.raises(RuntimeError, match="plan broke"):
        await asyncio.wait_for(queue.enqueue(_req("b", 8)), 60)
    queue.prefiller.plan_pass = real_plan
    pkg = await asyncio.wait_for(queue.enqueue(_req("c", 8)), 60)  # still serving
    assert pkg.seq_len == 8
    assert queue.waiting_requests == 0 and queue.jobs == []


async def test_a_second_stall_moves_the_end_instead_of_queueing_another(tiny_model):
    """The fault tests stall replicas reached at random: a replica hit twice must be held
    until the later end, not for the sum of both stalls."""
    import threading
    import time

    from app.prefill_queue import _STALL_ENDS, _stall

    core = EngineCore(EngineConfig(), model=tiny_model)
    _stall(core, 0.3)
    first_end = _STALL_ENDS[id(core)]
    _stall(core, 0.6)
    assert _STALL_ENDS[id(core)] > first_end
    assert sum(t.name == "fault-stall" for t in threading.enumerate()) == 1
    deadline = time.monotonic() + 30
    while not core.runner.lock.locked() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # the holder takes the model
    assert core.runner.lock.locked()
    assert core.runner.lock.acquire(timeout=60)  # released once the later end has passed
    core.runner.lock.release()
    assert time.monotonic() >= first_end and id(core) not in _STALL_ENDS


async def test_a_short_prompt_arriving_mid_pass_is_computed_before_the_rest_of_the_pass(
        tiny_model):
    """A document's pass runs a layer at a time (prefill_preempt_layers=1); a chat that
    arrives after its first layer gets a pass of its own before the document's second layer,
    and the document's result is the one an uninterrupted pass gives."""
    queue = _queue(tiny_model, prefix_cache_mb=0, prefill_chunk_tokens=64,
                   prefill_preempt_layers=1)
    alone = queue.prefiller.make_packages([_req("ref", 60)])[0]
    first_layer, chat_queued = threading.Event(), threading.Event()
    done: list[str] = []
    real_advance = queue.prefiller.advance

    def advance(run, layers=None):
        out = real_advance(run, layers)
        if [j.req.request_id for j in run.rows] == ["doc"] and run.layers_done == 1:
            first_layer.set()
            assert chat_queued.wait(60)  # the engine thread holds here until the chat waits
        return out

    queue.prefiller.advance = advance

    async def finish(rid, n):
        pkg = await queue.enqueue(_req(rid, n))
        done.append(rid)
        return pkg

    doc = asyncio.create_task(finish("doc", 60))
    assert await asyncio.to_thread(first_layer.wait, 60)
    chat = asyncio.create_task(finish("chat", 6))
    await asyncio.sleep(0)  # the chat's job is queued
    chat_queued.set()
    doc_pkg, chat_pkg = await asyncio.wait_for(asyncio.gather(doc, chat), 120)
    assert done == ["chat", "doc"] and queue.preemptions == 1
    assert doc_pkg.first_token == alone.first_token
    np.testing.assert_array_equal(doc_pkg.kv, alone.kv)
    assert chat_pkg.seq_len == 6
    assert queue.passes == 2 and queue.waiting_requests == 0 and queue.jobs == []


async def test_passes_run_whole_with_preemption_off(tiny_model):
    queue = _queue(tiny_model, prefix_cache_mb=0, prefill_preempt_layers=0)
    calls = []
    real_advance = queue.prefiller.advance
    queue.prefiller.advance = lambda run, layers=None: calls.append(layers) or real_advance(
        run, layers)
    await asyncio.wait_for(queue.enqueue(_req("a", 20)), 60)
    assert calls == [None]


async def test_two_lanes_run_two_documents_side_by_side_and_give_what_one_pass_gives(
        tiny_model):
    """prefill_lanes: 2: the second document's pass runs beside the first's, on an engine
    thread of its own (one torch thread, nice 19), not after it; neither pass takes the
    runner's lock or idle cores while the other runs; every package is the one a pass
    alone gives; a chat that arrives while both lanes are busy is computed on lane 0 (the
    extra lanes take long prompts only)."""
    queue = _queue(tiny_model, lanes=2, prefix_cache_mb=0, prefill_chunk_tokens=16,
                   prefill_preempt_layers=1)
    refs = {rid: queue.prefiller.make_packages([_req(rid, n)])[0]
            for rid, n in (("doc-a", 40), ("doc-b", 41), ("chat", 6))}
    both_in = threading.Barrier(2, timeout=60)  # breaks unless the two passes overlap
    seen: dict[str, tuple[str, int, bool]] = {}
    real_advance = queue.prefiller.advance

    def advance(run, layers=None, *, alone=True):
        rid = run.rows[0].req.request_id
        if rid not in seen:
            seen[rid] = (threading.current_thread().name,
                         os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), alone)
            if rid.startswith("doc"):
                both_in.wait()
        return real_advance(run, layers, alone=alone)

    queue.prefiller.advance = advance
    docs = [asyncio.create_task(queue.enqueue(_req(rid, n)))
            for rid, n in (("doc-a", 40), ("doc-b", 41))]
    while len(seen) < 2:
        await asyncio.sleep(0.01)
    chat = asyncio.create_task(queue.enqueue(_req("chat", 6)))
    pkgs = await asyncio.wait_for(asyncio.gather(*docs, chat), 120)
    for rid, pkg in zip(("doc-a", "doc-b", "chat"), pkgs, strict=True):
        assert pkg.first_token == refs[rid].first_token, rid
        np.testing.assert_allclose(pkg.kv, refs[rid].kv, rtol=1e-5, atol=1e-6)
    threads = {seen[rid][0].split("_")[0] for rid in ("doc-a", "doc-b")}
    assert threads == {"engine", "engine-lane1"}
    lane1 = next(v for v in seen.values() if v[0].startswith("engine-lane1"))
    assert lane1[1] == 19
    assert not seen["doc-a"][2] and not seen["doc-b"][2]  # side by side: neither alone
    assert seen["chat"][0].startswith("engine_")
    assert queue.lane_passes >= 1 and queue.thread_stats()["extra_lane_passes"] >= 1
    assert queue.waiting_requests == 0 and queue.jobs == [] and not queue._running


async def test_an_injected_stall_holds_every_lane(tiny_model):
    """The fault tests' stall holds the runner's lock, which passes beside another do not
    take: they wait for the stall's end too, so a stalled replica computes nothing."""
    import time

    from app.prefill_queue import _stall

    queue = _queue(tiny_model, lanes=2, prefix_cache_mb=0, prefill_chunk_tokens=16)
    started = time.monotonic()
    _stall(queue.core, 1.0)
    pkgs = await asyncio.wait_for(asyncio.gather(queue.enqueue(_req("doc-a", 40)),
                                                 queue.enqueue(_req("doc-b", 41))), 120)
    assert time.monotonic() - started >= 1.0
    assert [p.seq_len for p in pkgs] == [40, 41]
