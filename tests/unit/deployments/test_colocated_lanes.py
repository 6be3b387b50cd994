"""The colocated app with ``prefill_lanes: 2``: a long prompt's pass runs on an extra lane (a
thread of its own) while the engine thread runs the running streams' decode steps (with
``mixed_batch``, the other prompts' chunks riding in them), and every answer is the one the
app gives a request alone. The real server class on the tiny model, without Ray
(``rayless_replicas``)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from app.messages import PrefillRequest, StreamStart
from app.sampling import SamplingParams
from deployments.colocated_server import ColocatedServer

LONG = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
STREAM = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def _server(lanes: int, mixed: bool) -> Any:
    engine = {"prefix_cache_mb": 0, "mixed_batch": mixed, "prefill_lanes": lanes,
              "prefill_chunk_tokens": 16, "prefill_preempt_layers": 0}
    return ColocatedServer.func_or_class({"engine": engine, "colocated": {"num_threads": 1}})


async def _tokens(server: Any, req: PrefillRequest) -> list[int]:
    items = [item async for item in server.generate_local(req)]
    assert isinstance(items[0], StreamStart)
    return [e.token_id for e in items[1:]]


@pytest.mark.parametrize("mixed", [False, True])
async def test_a_long_prompt_on_an_extra_lane_runs_beside_the_decode_steps(rayless_replicas,
                                                                          mixed):
    server = _server(lanes=2, mixed=mixed)
    docs = {rid: PrefillRequest(rid, tuple(range(base, base + n)), LONG)
            for rid, base, n in (("doc-a", 200, 40), ("doc-b", 300, 41))}
    chat = PrefillRequest("chat", tuple(range(50, 56)), STREAM)
    try:
        alone = {rid: await _tokens(server, req) for rid, req in docs.items()}
        chat_alone = await _tokens(server, chat)

        # a pass on the extra lane waits inside itself until a decode step has run: the
        # test fails (the wait times out) unless the two overlap
        lane_in, step_ran = threading.Event(), threading.Event()
        lane_threads: list[str] = []
        real_advance, real_step = server.batcher.prefiller.advance, server.loop.decoder.step

        def advance(run, layers=None, *, alone=True):
            name = threading.current_thread().name
            if name.startswith("engine-lane") and not lane_in.is_set():
                lane_threads.append(name)
                lane_in.set()
                assert step_ran.wait(60), "no decode step ran beside the extra lane's pass"
            return real_advance(run, layers, alone=alone)

        def step(plan=None):
            if lane_in.is_set():
                step_ran.set()
            return real_step(plan)

        server.batcher.prefiller.advance = advance
        server.loop.decoder.step = step
        streaming = asyncio.create_task(_tokens(server, chat))
        for _ in range(6000):  # the chat decodes before the documents come (60 s at most)
            if server.loop.decoder.running or streaming.done():
                break
            await asyncio.sleep(0.01)
        assert server.loop.decoder.running, "the chat never started decoding"
        together = await asyncio.wait_for(
            asyncio.gather(*(_tokens(server, req) for req in docs.values())), 120)
        chat_together = await asyncio.wait_for(streaming, 120)
    finally:
        await server.loop.close()
        if server._stats_task is not None:
            server._stats_task.cancel()
    assert lane_threads and step_ran.is_set()
    assert dict(zip(docs, together, strict=True)) == alone  # greedy: the same answers
    assert chat_together == chat_alone and len(chat_alone) == 400
    assert server.batcher.lane_passes >= 1
    if mixed:  # the other document's chunks rode in the decode steps
        assert server.batcher.mixed_passes >= 1
