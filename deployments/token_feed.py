"""One Ray stream item per decode step for all of an ingress's streams on a decode replica.

A decode stream sent token by token costs each token one Ray streaming-generator item: its
report on the decode replica (three threads of Serve's and Ray's) and its receipt on the
ingress. At 8 streams a step that is 8 items where one would do, and on a small machine
those items take the cores the decode step needs. vLLM's engine sends its API server one
message per step for every request; this is that for Ray Serve.

An ingress opens one *feed* per decode replica it streams from (:class:`FeedHub`): a
long-lived streaming call, pinned to that replica by :class:`FeedRouter`, that yields each
step's tokens for every stream of that ingress as one list (:class:`FeedOut`). A request's
own stream still carries its :class:`~app.messages.StreamStart` (``fed`` set when its
tokens go through the feed), its errors and its end, so routing, cancellation, the KV
reference's lifetime and resuming after a lost replica are as before. A feed that breaks
fails the requests it carried with a retryable error (they resume elsewhere); a feed ends
by itself after ``FEED_IDLE_S`` with no stream attached, so a draining replica is not held.
A stream that starts while its ingress has no feed on its replica (the first, or after a
feed ended) streams its tokens itself, and the ingress opens the feed for the next ones.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from app.errors import ReplicaUnhealthyError
from app.messages import StreamStart, TokenEvent

logger = logging.getLogger(__name__)

FEED_IDLE_S = 2.0  # a feed with no stream attached for this long ends
CONNECT_TIMEOUT_S = 10.0  # a feed not confirmed by its replica within this is given up
REFUSED_RETRY_S = 30.0  # after a feed reached the wrong replica, per-token streams this long
REPLICA_KWARG = "on_replica"  # a call's keyword naming the replica it must reach (FeedRouter)


class FeedLost(ReplicaUnhealthyError):
    """The feed that carried a stream's tokens broke: the stream resumes elsewhere."""


class FeedOut:
    """The decode replica's side of one ingress's feed: tokens pushed by that ingress's
    streams, yielded a step's worth at a time."""

    def __init__(self) -> None:
        self.buffer: list[TokenEvent] = []
        self.wake = asyncio.Event()
        self.attached = 0  # streams whose tokens go through this feed
        self.closed = False

    def push(self, event: TokenEvent) -> None:
        if self.closed:
            raise FeedLost("the token feed to the ingress closed")
        self.buffer.append(event)
        self.wake.set()

    async def batches(self) -> AsyncIterator[list[TokenEvent]]:
        """Everything pushed since the last batch, as soon as there is something; ends when
        nothing was pushed for ``FEED_IDLE_S`` and no stream is attached."""
        idle_s = FEED_IDLE_S
        while True:
            if not self.buffer:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), idle_s)
                except (TimeoutError, asyncio.TimeoutError):
                    if self.attached == 0 and not self.buffer:
                        return
                    continue
            await asyncio.sleep(0)  # the step's other streams push theirs first
            out, self.buffer = self.buffer, []
            yield out


async def serve_feed(feeds: dict[str, FeedOut], ingress_id: str, replica_id: str,
                     wanted: str) -> AsyncIterator[Any]:
    """The decode replica's ``feed`` call: its own id first (a feed that reached another
    replica than ``wanted`` ends there), then the batches of ``ingress_id``'s streams."""
    yield replica_id
    if wanted != replica_id:
        return
    out = FeedOut()
    old = feeds.get(ingress_id)
    if old is not None:
        old.closed = True  # its ingress replaced it: streams still on it resume
    feeds[ingress_id] = out
    try:
        async for batch in out.batches():
            yield batch
    finally:
        out.closed = True
        if feeds.get(ingress_id) is out:
            del feeds[ingress_id]


class FeedHub:
    """The ingress's side: its feeds, one per decode replica, and each open request's
    queue, into which the feeds sort the tokens."""

    def __init__(self, decode: Any) -> None:
        self.decode = decode  # the decode (or colocated) deployment's handle
        self.id = uuid.uuid4().hex  # this ingress, as the decode replicas know it
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.attached: dict[str, set[str]] = {}  # replica id -> request ids fed by it
        self.feeds: dict[str, asyncio.Task[None]] = {}
        self.refused: dict[str, float] = {}  # replica id -> monotonic time of a misroute
        self.live: set[str] = set()  # replica ids whose feed is confirmed and open
        self.tokens = 0  # tokens received through feeds
        self.batches = 0  # the Ray stream items that carried them

    def stats(self) -> dict[str, int]:
        return {"token_feeds_open": len(self.live), "token_feed_tokens": self.tokens,
                "token_feed_items": self.batches}

    def open(self, request_id: str) -> asyncio.Queue[Any]:
        """Before a request's stream is called: where its fed tokens will arrive."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        for rids in self.attached.values():
            rids.discard(request_id)

    def started(self, start: StreamStart, request_id: str) -> bool:
        """A request's stream started: True when its tokens come through its replica's
        feed; else (no feed there yet) one is opened for the next streams."""
        replica_id = start.replica_id
        if start.fed:
            self.attached.setdefault(replica_id, set()).add(request_id)
            if replica_id not in self.feeds:  # it ended between the stream's start and now
                self._fail(replica_id, FeedLost(f"token feed from {replica_id} ended"))
            return True
        if not replica_id or replica_id in self.feeds:
            return False
        refused = self.refused.get(replica_id)
        if refused is not None and time.monotonic() - refused < REFUSED_RETRY_S:
            return False
        # a context of its own: a call made in a request's context is that request's child,
        # and Serve cancels it when the request is cancelled (its client went away)
        self.feeds[replica_id] = asyncio.get_running_loop().create_task(
            self._read(replica_id), name=f"token-feed-{replica_id}",
            context=contextvars.Context())
        return False

    async def _read(self, replica_id: str) -> None:
        pin = {REPLICA_KWARG: replica_id}
        stream = self.decode.options(stream=True).feed.remote(self.id, **pin)
        error: BaseException = FeedLost(f"token feed from {replica_id} ended")
        try:
            first = await asyncio.wait_for(stream.__aiter__().__anext__(), CONNECT_TIMEOUT_S)
            if first != replica_id:
                self.refused[replica_id] = time.monotonic()
                logger.info("token feed for %s reached %s: per-token streams", replica_id,
                            first)
                return
            self.live.add(replica_id)
            async for batch in stream:
                self.tokens += len(batch)
                self.batches += 1
                for event in batch:
                    queue = self.queues.get(event.request_id)
                    if queue is not None:
                        queue.put_nowait(event)
        except StopAsyncIteration:
            pass
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the replica or its node went away
            logger.warning("token feed from %s broke: %r", replica_id, exc)
            error = exc
        finally:
            stream.cancel()
            self.live.discard(replica_id)
            self.feeds.pop(replica_id, None)
            self._fail(replica_id, error)

    def _fail(self, replica_id: str, error: BaseException) -> None:
        for rid in self.attached.pop(replica_id, set()):
            queue = self.queues.get(rid)
            if queue is not None:
                queue.put_nowait(error)

    async def close_all(self) -> None:
        for task in list(self.feeds.values()):
            task.cancel()


_END = object()


async def fed_tokens(stream: Any, queue: asyncio.Queue[Any]) -> AsyncIterator[TokenEvent]:
    """A fed request's tokens: from its queue, until its last token; the rest of its own
    stream (its end, or the error that ends it) is watched meanwhile."""
    async def watch() -> None:
        try:
            async for _ in stream:
                pass
            queue.put_nowait(_END)
        except BaseException as exc:  # handed to the reader
            queue.put_nowait(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        while True:
            item = await queue.get()
            if item is _END:
                continue  # the decode side is done; its last tokens are in the feed
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return
    finally:
        watcher.cancel()


class FeedRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's default router for a decode deployment, except that a call naming a replica
    (``on_replica=``: an ingress's token feed, one replica's stats) goes to that replica, or
    to any when that one is gone (the answer says which replica it came from)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        wanted = (pending_request.kwargs or {}).get(REPLICA_KWARG) if pending_request else None
        if wanted is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        pinned = [r for r in candidate_replicas if r.replica_id.unique_id == wanted]
        return [pinned] if pinned else [candidate_replicas]
