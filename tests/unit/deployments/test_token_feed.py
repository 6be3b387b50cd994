"""The token feed (deployments.token_feed) between the ingress's split path and the decode
replica's real stream code (``DecodeServer.generate_local``, ``DecodeReplica._stream`` and
``feed``) on a fake batch, in one event loop, no Ray: every stream's tokens arrive whole
and in order, one feed item per step carries all streams' tokens, a broken feed makes its
streams resume with nothing missing or repeated, a feed that reached another replica is
not used, and an idle feed ends."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from app.messages import FinishReason, PrefillRequest, TokenEvent
from app.sampling import SamplingParams
from deployments import token_feed
from deployments.decode_server import DecodeServer
from deployments.replica import DecodeReplica
from deployments.request_trace import RequestTrace
from deployments.retries import is_retryable
from deployments.split_path import SplitPath
from deployments.token_feed import FeedHub, FeedLost, FeedOut
from tests.unit.deployments.test_split_path import FakeCall

LENGTH = 6


class FakeBatch:
    """A decode loop's stand-in: every step gives each running sequence its next token,
    all of a step's tokens delivered together, as ``DecodeLoop`` delivers them."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self.steps = 0
        self.task: asyncio.Task[None] | None = None

    async def generate(self, preq: PrefillRequest):
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.queues[preq.request_id] = queue
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())
        try:
            while True:
                event = await queue.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self.queues.pop(preq.request_id, None)

    async def _run(self) -> None:
        made: dict[str, int] = {}
        while True:
            await asyncio.sleep(0.002)
            if self.queues:
                self.steps += 1
            for rid, queue in list(self.queues.items()):
                preq = REQUESTS[rid]
                i = preq.output_offset + made.get(rid, 0)
                made[rid] = made.get(rid, 0) + 1
                last = i == LENGTH - 1
                queue.put_nowait(TokenEvent(rid, 1000 + i, i,
                                            FinishReason.LENGTH if last else None))


REQUESTS: dict[str, PrefillRequest] = {}


class Replica:
    """The real decode replica code (stream, feed) over a FakeBatch."""

    _stream = DecodeReplica._stream
    feed = DecodeReplica.feed
    ping = DecodeReplica.ping
    generate_local = DecodeServer.func_or_class.generate_local

    def __init__(self, replica_id: str = "replica-a") -> None:
        self.replica_id = replica_id
        self.node_id = "node"
        self.feeds: dict[str, FeedOut] = {}
        self.unhealthy = None
        self.started = 0
        self.loop = FakeBatch()

    def _ensure_stats_task(self) -> None:
        pass

    async def make_kv_package(self, preq: PrefillRequest) -> Any:
        REQUESTS[preq.request_id] = preq
        return preq  # the FakeBatch decodes the request itself


class Handle:
    """A Serve handle on one replica: ``options(...).method.remote(*args, **kwargs)``."""

    def __init__(self, replica: Replica, break_feed_after: int | None = None) -> None:
        self.replica = replica
        self.calls: list[str] = []
        self.break_feed_after = break_feed_after

    def options(self, **_: Any) -> Handle:
        return self

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.replica, name)
        handle = self

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> FakeCall:
                handle.calls.append(name)
                result = method(*args, **kwargs)
                if not hasattr(result, "__aiter__"):
                    return FakeCall(value=result)
                if name == "feed" and handle.break_feed_after is not None:
                    result = handle._breaking(result)
                return FakeCall(stream=result)

        return _Method

    async def _breaking(self, stream):
        """The feed call dies after a few items; Ray ends the replica's side with it."""
        n = 0
        async for item in stream:
            if n > self.break_feed_after:
                await stream.aclose()
                raise ray.exceptions.ActorDiedError()
            n += 1
            yield item


def request(rid: str) -> PrefillRequest:
    return PrefillRequest(rid, (1, 2, 3), SamplingParams(max_tokens=LENGTH))


@pytest.fixture(autouse=True)
def _package_fields(monkeypatch):
    """generate_local reads a package's accounting fields; the fake package is the request."""
    for name, value in (("kv_nbytes", 0), ("prefill_s", 0.0), ("created_at", 0.0),
                        ("cached_tokens", 0)):
        monkeypatch.setattr(PrefillRequest, name, value, raising=False)
    REQUESTS.clear()


def path_on(handle: Handle, feeds: FeedHub | None) -> SplitPath:
    return SplitPath(None, handle, local_prefill_threshold=0, request_timeout_s=30.0,
                     max_retries=2, retry_backoff_s=0.0, feeds=feeds)


async def tokens_of(path: SplitPath, rid: str) -> list[int]:
    preq = request(rid)
    return [e.token_id async for e in path.resumable_stream(preq, RequestTrace())]


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


EXPECTED = [1000 + i for i in range(LENGTH)]


async def test_streams_after_the_first_take_one_feed_item_per_step():
    replica = Replica()
    handle = Handle(replica)
    hub = FeedHub(handle)
    path = path_on(handle, hub)
    assert await tokens_of(path, "first") == EXPECTED  # no feed yet: its own stream
    assert hub.tokens == 0 and "feed" in handle.calls
    await until(lambda: hub.id in replica.feeds)
    steps_before = replica.loop.steps
    answers = await asyncio.gather(*(tokens_of(path, f"r{k}") for k in range(8)))
    assert answers == [EXPECTED] * 8
    assert hub.tokens == 8 * LENGTH  # every token of the eight came through the feed
    steps = replica.loop.steps - steps_before
    assert hub.batches <= steps + 1  # one item a step, not one a token (8 a step)
    assert hub.queues == {} and all(not rids for rids in hub.attached.values())
    await hub.close_all()


async def test_without_a_hub_every_stream_carries_its_own_tokens():
    replica = Replica()
    handle = Handle(replica)
    path = path_on(handle, None)
    assert await asyncio.gather(tokens_of(path, "a"), tokens_of(path, "b")) == [EXPECTED] * 2
    assert "feed" not in handle.calls and replica.feeds == {}


async def test_a_broken_feed_makes_its_streams_resume_with_no_token_lost_or_repeated():
    replica = Replica()
    handle = Handle(replica, break_feed_after=3)  # the hello and three batches, then dies
    hub = FeedHub(handle)
    path = path_on(handle, hub)
    await tokens_of(path, "opens-the-feed")
    await until(lambda: hub.id in replica.feeds)
    broken = replica.feeds[hub.id]
    answers = await asyncio.gather(*(tokens_of(path, f"r{k}") for k in range(3)))
    assert answers == [EXPECTED] * 3  # resumed where the broken feed left each
    assert 0 < hub.tokens < 3 * LENGTH
    assert broken.closed and replica.feeds.get(hub.id) is not broken
    await hub.close_all()


def test_a_lost_feed_is_an_error_the_split_path_retries():
    assert is_retryable(FeedLost("gone"))
    assert is_retryable(ray.exceptions.ActorDiedError())


async def test_a_stream_on_a_closed_feed_raises_a_retryable_error():
    out = FeedOut()
    out.closed = True
    with pytest.raises(FeedLost):
        out.push(TokenEvent("r", 1, 0))


async def test_a_feed_that_reaches_another_replica_is_not_used():
    replica = Replica("replica-b")
    handle = Handle(replica)
    hub = FeedHub(handle)
    hub.feeds["replica-a"] = asyncio.get_running_loop().create_task(
        hub._read("replica-a"))  # as if the router could not pin replica-a's feed
    await until(lambda: "replica-a" not in hub.feeds)
    assert "replica-a" in hub.refused and replica.feeds == {}
    hub.started(SimpleNamespace(replica_id="replica-a", fed=False), "x")
    assert "replica-a" not in hub.feeds  # not retried at once


async def test_an_idle_feed_ends_and_frees_its_place(monkeypatch):
    monkeypatch.setattr(token_feed, "FEED_IDLE_S", 0.05)
    replica = Replica()
    handle = Handle(replica)
    hub = FeedHub(handle)
    path = path_on(handle, hub)
    await tokens_of(path, "first")
    await until(lambda: hub.id in replica.feeds)
    await until(lambda: hub.feeds == {} and replica.feeds == {})
    assert await tokens_of(path, "again") == EXPECTED  # per-token again, feed reopened
    await until(lambda: hub.id in replica.feeds)
    await hub.close_all()
