"""One scheduler, two users: the engine's prefill planning (``app.prefill.Prefiller``) and the
capacity planner's simulated queue (``planner.sim.engine._PrefillQueue``) run the same policy
(``app.prefill_policy.PrefillPolicy``). Driven with one arrival sequence, pass by pass, they
choose the same prompts and the same chunks; and the planner's default bounds are the app's."""

from __future__ import annotations

import random

import pytest

from app.config import EngineConfig
from app.messages import PrefillRequest
from app.prefill import PrefillJob
from app.sampling import SamplingParams
from planner.sim import Arrival, EngineLimits
from planner.sim.engine import _PrefillQueue, _Req

PASS_S = 0.4  # simulated time a pass (or a mixed step) takes


def _arrivals(seed: int, n: int = 40) -> list[tuple[float, int]]:
    """(arrival time, prompt length): short chats among long documents, in bursts."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.choice((0.0, 0.0, 0.05, 0.3, 1.2))
        out.append((t, rng.choice((12, 40, 64, 100, 300, 700, 1500))))
    return out


def _drive(prefiller, queue: _PrefillQueue, arrivals, decode_rows: int | None):
    """Both planners over the same arrivals; yields each pass's choices from both sides as
    (prompt index, chunk) lists. ``decode_rows``: plan mixed-step chunks, else passes."""
    jobs: list[PrefillJob] = []
    reqs: dict[int, int] = {}  # id(_Req) -> prompt index
    pending = list(enumerate(arrivals))
    now = 0.0
    while pending or any(j.remaining for j in jobs):
        while pending and pending[0][1][0] <= now:
            i, (_, length) = pending.pop(0)
            job = PrefillJob(PrefillRequest(f"r{i}", tuple(range(3, 3 + length)),
                                            SamplingParams(max_tokens=1, temperature=0.0)),
                             arrived=now)
            jobs.append(job)
            r = _Req(Arrival(now, length, 1), now, i)
            reqs[id(r)] = i
            queue.add(r, now)
        live = [j for j in jobs if j.remaining]
        if decode_rows is None:
            rows = prefiller.plan_pass(live, now)
            engine = [(int(j.req.request_id[1:]), prefiller.chunk_of(j)) for j in rows]
            planned = queue.plan(now)
            sim = [(reqs[id(r)], queue.chunk_of(r)) for r in planned]
            queue.advance(planned)
        else:
            plan = prefiller.plan_chunks(live, decode_rows, now)
            pairs = [] if plan is None else zip(plan.rows, plan.sizes, strict=True)
            engine = [(int(j.req.request_id[1:]), n) for j, n in pairs]
            chunks = queue.plan_chunks(now, decode_rows)
            sim = [(reqs[id(r)], n) for r, n in zip(chunks.rows, chunks.sizes, strict=True)]
            queue.advance(chunks.rows, chunks.sizes)
        for i, n in engine:
            jobs[i].done += n
        yield engine, sim
        now += PASS_S


@pytest.mark.parametrize("settings", [
    {},
    {"prefill_batch_tokens": 128},
    {"prefill_chunk_tokens": 512, "prefill_fairness_s": 1.0, "prefill_max_batch_size": 4},
    {"prefill_token_budget": 300, "prefill_fairness_s": 0.5},
])
@pytest.mark.parametrize("decode_rows", [None, 0, 6, 200])
def test_the_engine_and_the_simulator_choose_the_same_passes(tiny_model, settings, decode_rows):
    from app.engine_core import EngineCore

    config = EngineConfig(device="cpu", max_kv_tokens=4096, max_model_len=4096, **settings)
    prefiller = EngineCore(config, model=tiny_model).make_prefiller()
    limits = EngineLimits(
        token_budget=config.prefill_token_budget, prefill_max_rows=config.prefill_max_batch_size,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        prefill_batch_tokens=config.prefill_batch_tokens,
        prefill_fairness_s=config.prefill_fairness_s)
    queue = _PrefillQueue(None, limits)
    passes = shared = 0
    for k, (engine, sim) in enumerate(_drive(prefiller, queue, _arrivals(7), decode_rows)):
        assert engine == sim, f"pass {k}: engine {engine} vs simulator {sim}"
        passes += bool(engine)
        shared += len(engine) > 1
    assert passes > 20 and shared > 3  # a real schedule: many passes, some of several prompts


def test_the_planners_defaults_are_the_apps():
    from deployments.args import AppArgs

    assert EngineLimits.from_app_args(AppArgs()) == EngineLimits()
