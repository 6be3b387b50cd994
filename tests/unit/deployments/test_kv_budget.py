"""The KV budget (backpressure from decode to prefill): what fits goes at once, what does not
waits, a waiter past the fairness bound is overtaken by nobody, a package larger than the
budget goes alone, a cancelled waiter leaves no trace; and on the split path (fake handles),
prefill is not called for a prompt that does not fit until a stream holding room has
ended."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from app.errors import RequestTimeoutError
from app.messages import PrefillRequest
from app.sampling import SamplingParams
from deployments.kv_budget import KVBudget, budget_from_cluster
from deployments.request_trace import RequestTrace
from tests.unit.deployments.test_split_path import (
    TOKENS,
    FakeCall,
    FakeHandle,
    split_path,
    token_stream,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_what_fits_goes_and_what_does_not_waits_until_room_is_given_back():
    async def scenario():
        budget = KVBudget(100)
        a = await budget.reserve(60)
        b = await budget.reserve(40)
        assert budget.used == 100
        late = asyncio.ensure_future(budget.reserve(30))
        await settle()
        assert not late.done() and budget.waiting == 1
        a.release()
        c = await asyncio.wait_for(late, 1)
        assert budget.used == 70 and budget.peak == 100 and budget.waited == 1
        a.release()  # a second release of the same reservation gives nothing back twice
        assert budget.used == 70
        b.release()
        c.release()
        assert budget.used == 0
    asyncio.run(scenario())


def test_a_small_package_overtakes_a_large_waiter_until_the_fairness_bound():
    async def scenario():
        clock = Clock()
        budget = KVBudget(100, fairness_s=5.0, clock=clock)
        held = await budget.reserve(80)
        big = asyncio.ensure_future(budget.reserve(50))
        await settle()
        small = await asyncio.wait_for(budget.reserve(10), 1)  # fits: goes past the waiter
        assert not big.done()
        small.release()
        clock.now = 6.0  # the large waiter has now waited past the bound
        blocked = asyncio.ensure_future(budget.reserve(10))
        await settle()
        assert not blocked.done()  # it would fit, but nobody overtakes an elder
        held.release()
        await asyncio.wait_for(big, 1)
        await asyncio.wait_for(blocked, 1)
        assert budget.used == 60
    asyncio.run(scenario())


def test_a_package_larger_than_the_budget_goes_alone():
    async def scenario():
        budget = KVBudget(100)
        huge = await budget.reserve(500)  # nothing reserved: it goes
        other = asyncio.ensure_future(budget.reserve(1))
        await settle()
        assert not other.done()
        huge.release()
        (await asyncio.wait_for(other, 1)).release()
        assert budget.used == 0
    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_no_reservation_and_unblocks_the_line():
    async def scenario():
        clock = Clock()
        budget = KVBudget(100, fairness_s=1.0, clock=clock)
        held = await budget.reserve(90)
        elder = asyncio.ensure_future(budget.reserve(50))
        await settle()
        clock.now = 2.0
        young = asyncio.ensure_future(budget.reserve(5))
        await settle()
        assert not young.done()
        elder.cancel()  # the elder's client left (or its deadline passed)
        await asyncio.wait_for(young, 1)
        assert budget.waiting == 0 and budget.used == 95
        held.release()
        assert budget.used == 5
    asyncio.run(scenario())


def test_the_default_budget_is_a_share_of_the_smallest_live_object_store():
    nodes = [{"Alive": True, "Resources": {"object_store_memory": 400e6}},
             {"Alive": True, "Resources": {"object_store_memory": 100e6}},
             {"Alive": False, "Resources": {"object_store_memory": 10e6}}]
    assert budget_from_cluster(nodes, 0.5, 1) == 50_000_000
    assert budget_from_cluster(nodes, 0.5, 2) == 25_000_000
    with pytest.raises(ValueError, match="kv_in_flight_bytes"):
        budget_from_cluster([{"Alive": True, "Resources": {}}], 0.5, 1)


# ---- on the split path --------------------------------------------------------------------

def held_decode() -> tuple[FakeHandle, dict[str, asyncio.Event]]:
    """A decode handle whose stream for request R ends only once ``gates[R]`` is set (it
    starts and streams all but its last token at once)."""
    gates: dict[str, asyncio.Event] = {}

    def generate(wrapped: list[Any], choice: Any = None) -> FakeCall:
        preq: PrefillRequest = wrapped[0]

        async def gen() -> AsyncIterator[Any]:
            items = [item async for item in token_stream(preq)]
            for item in items[:-1]:
                yield item
            await gates.setdefault(preq.request_id, asyncio.Event()).wait()
            yield items[-1]
        return FakeCall(stream=gen())
    return FakeHandle(generate=generate), gates


def prompt(rid: str, tokens: int) -> PrefillRequest:
    return PrefillRequest(rid, tuple(range(tokens)), SamplingParams(max_tokens=len(TOKENS),
                                                                    temperature=0.0))


def test_prefill_waits_for_a_stream_to_end_when_the_budget_is_full():
    """Budget: two 10-token packages. A third prompt is not sent to prefill until one of the
    first two streams has ended (its package leaves the store with it); its wait is in its
    trace; all three end with every token and the budget is empty afterwards."""
    async def scenario():
        prefill = FakeHandle(make_kv_package=lambda preq: FakeCall(value=preq))
        decode, gates = held_decode()
        budget = KVBudget(2 * 10 * 100)
        path = split_path(prefill, decode, kv_budget=budget, kv_bytes_per_token=100)
        traces = [RequestTrace() for _ in range(3)]

        async def run(i: int) -> list[int]:
            return [e.token_id async for e in path.resumable_stream(
                prompt(f"r{i}", 10), traces[i])]

        tasks = [asyncio.ensure_future(run(i)) for i in range(3)]
        await asyncio.sleep(0.05)
        assert [args[0].request_id for _, args in prefill.calls] == ["r0", "r1"]
        assert budget.used == 2000 and budget.waiting == 1
        assert budget.used == 2000  # streaming: the packages are still in the store
        gates.setdefault("r0", asyncio.Event()).set()  # r0's stream ends
        await asyncio.sleep(0.05)
        assert [args[0].request_id for _, args in prefill.calls] == ["r0", "r1", "r2"]
        for rid in ("r1", "r2"):
            gates.setdefault(rid, asyncio.Event()).set()
        out = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert out == [TOKENS] * 3
        assert budget.used == 0 and budget.peak == 2000
        assert traces[2].kv_budget_wait_s > 0 and traces[0].kv_budget_wait_s == 0
    asyncio.run(scenario())


def test_a_request_whose_deadline_passes_waiting_for_room_gets_a_timeout_and_frees_it():
    async def scenario():
        prefill = FakeHandle(make_kv_package=lambda preq: FakeCall(value=preq))
        decode, _gates = held_decode()
        budget = KVBudget(1000)
        patient = split_path(prefill, decode, kv_budget=budget, kv_bytes_per_token=100)
        hasty = split_path(prefill, decode, kv_budget=budget, kv_bytes_per_token=100,
                           request_timeout_s=0.3)
        first = asyncio.ensure_future(
            _collect(patient.resumable_stream(prompt("r0", 10), RequestTrace())))
        await asyncio.sleep(0.05)
        with pytest.raises(RequestTimeoutError):
            await _collect(hasty.resumable_stream(prompt("r1", 10), RequestTrace()))
        assert [args[0].request_id for _, args in prefill.calls] == ["r0"]  # never prefilled
        assert budget.used == 1000 and budget.waiting == 0
        first.cancel()  # r0's client leaves: its room is given back
        with pytest.raises(asyncio.CancelledError):
            await first
        assert budget.used == 0
    asyncio.run(scenario())


def test_a_shared_package_holds_its_room_until_the_caller_releases_it():
    """n > 1: the answers' streams read one object, so its room is held until the caller
    (the ingress, once every answer has ended) releases it."""
    async def scenario():
        prefill = FakeHandle(make_kv_package=lambda preq: FakeCall(value=preq))
        decode = FakeHandle(generate=lambda wrapped, choice=None: FakeCall(
            stream=token_stream(wrapped[0])))
        budget = KVBudget(10_000)
        path = split_path(prefill, decode, kv_budget=budget, kv_bytes_per_token=100)
        preq = PrefillRequest("req", tuple(range(20)),
                              SamplingParams(max_tokens=len(TOKENS), seed=1), n=2)
        shared = await path.shared_prefill(preq)
        assert budget.used == 2000
        for k in range(2):
            out = await _collect(path.resumable_stream(preq, RequestTrace(), (shared, k)))
            assert [e.token_id for e in out] == TOKENS
            assert budget.used == 2000
        shared.reservation.release()
        assert budget.used == 0
    asyncio.run(scenario())


async def _collect(stream: AsyncIterator[Any]) -> list[Any]:
    return [e async for e in stream]

