"""The split path of one request: prefill -> KV ref -> decode, and the token stream back,
resumed on another replica when one is lost.

A plain class over two Serve handles (or anything with the same ``.options(...)`` and
``.method.remote(...)`` shape), so unit tests drive it with fake handles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray

from app.errors import RequestTimeoutError
from app.messages import PrefillRequest, StreamStart, TokenEvent
from app.output import GenerationFailed
from deployments.kv_budget import KVBudget, Reservation
from deployments.request_trace import RequestTrace, kv_object_locations
from deployments.retries import is_retryable, resume_request, unwrap_error
from deployments.token_feed import FeedHub, fed_tokens

logger = logging.getLogger(__name__)


# Waiting for a phase to have a live replica again: each ping's limit, and the pause
# between pings that did not all answer.
REPLICA_PING_S = 5.0
REPLICA_POLL_S = 0.5


async def _answers_ping(handle: Any, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(handle.ping.remote(), timeout_s)
        return True
    except Exception:
        return False


@dataclasses.dataclass
class SharedPackage:
    """The one KV package of an ``n > 1`` request and its room in the KV budget, held until
    every answer's stream has ended (``SplitPath.shared_prefill``)."""

    ref: ray.ObjectRef
    reservation: Reservation
    local: bool = False  # made by a decode replica (or the colocated server)


class Backlog:
    """One prompt's tokens in ``SplitPath``'s backlog counts, from the moment it is sent to
    a phase until its stream starts (or it fails); ``drop`` takes them out, once."""

    def __init__(self, path: SplitPath, tokens: int, *, local: bool, short: bool) -> None:
        self.path, self.tokens, self.local, self.short = path, tokens, local, short
        self._count(+1)

    def _count(self, sign: int) -> None:
        n = sign * self.tokens
        if self.local:
            self.path.local_backlog_tokens += n
            return
        self.path.prefill_backlog_tokens += n
        if self.short:
            self.path.short_backlog_tokens += n

    def drop(self) -> None:
        if self.tokens:
            self._count(-1)
            self.tokens = 0


class SplitPath:
    """Runs requests through the phases.

    ``prefill`` is the PrefillServer handle, or None in the colocated app, where ``decode``
    (the ColocatedServer) prefills every prompt itself. ``kv_budget`` (with
    ``kv_bytes_per_token``) bounds the KV bytes in the object store, from a prompt's prefill
    until its stream ends: a prompt that does not fit waits before prefill
    (``deployments.kv_budget``).

    Where a prompt is prefilled: on the decode replica when it is shorter than
    ``local_prefill_threshold`` tokens; on the prefill phase when it is not shorter than
    ``local_prefill_when_busy``, or while that phase is not backed up
    (``prefill_backlog_tokens``, the prompt tokens this path has sent it whose streams have
    not started, under ``prefill_busy_tokens``: the hop costs the running streams nothing).
    A short prompt and a backed-up prefill phase: whichever side has fewer tokens ahead of
    it. On the decode replica that is every local prompt not yet streaming
    (``local_backlog_tokens``); on the prefill phase, which prefills shortest first, the
    short prompts there (``short_backlog_tokens``) and, when longer prompts wait there, two
    passes of them (``prefill_busy_tokens`` each): the pass under way, and the rest of the
    short prompt's own pass, which the planner fills with a longer prompt's chunk. Where the
    prefill phase pauses its passes between layers for short prompts
    (``prefill_preempts``: ``engine.prefill_preempt_layers``), the longer prompts count a
    quarter of a pass instead (the few layers until the pause). So a burst of chats is
    shared between the decode replicas' steps and the prefill phase by the tokens ahead on
    each side, and both phases' cores work on it.
    """

    def __init__(self, prefill: Any | None, decode: Any, *, local_prefill_threshold: int,
                 request_timeout_s: float, max_retries: int, retry_backoff_s: float,
                 locate: Callable[[Any], tuple[list[str], int | None]] = kv_object_locations,
                 kv_budget: KVBudget | None = None, kv_bytes_per_token: int = 0,
                 local_prefill_when_busy: int = 0, prefill_busy_tokens: int = 1,
                 prefill_preempts: bool = False, feeds: FeedHub | None = None) -> None:
        self.prefill = prefill
        self.decode = decode
        self.feeds = feeds  # the token feeds from the decode replicas (None: per-token)
        self.kv_budget = kv_budget
        self.kv_bytes_per_token = kv_bytes_per_token
        self.local_prefill_threshold = local_prefill_threshold
        self.local_prefill_when_busy = local_prefill_when_busy
        self.prefill_busy_tokens = max(1, prefill_busy_tokens)
        self.prefill_preempts = prefill_preempts
        # prompt tokens whose streams have not started: sent to the prefill phase, of those
        # the short ones (under local_prefill_when_busy), and sent to a decode replica
        self.prefill_backlog_tokens = 0
        self.short_backlog_tokens = 0
        self.local_backlog_tokens = 0
        self.local_when_busy = 0  # prompts prefilled locally because the phase was busy
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.locate = locate
        self.retries = 0  # re-runs across all requests

    async def readiness(self, timeout_s: float) -> dict[str, bool]:
        """Ready when both phases (or the colocated server) answer a ping."""
        if self.prefill is None:
            ok = await _answers_ping(self.decode, timeout_s)
            return {"ready": ok, "colocated": ok}
        prefill_ok, decode_ok = await asyncio.gather(_answers_ping(self.prefill, timeout_s),
                                                     _answers_ping(self.decode, timeout_s))
        return {"ready": prefill_ok and decode_ok, "prefill": prefill_ok, "decode": decode_ok}

    def _timeout(self, preq: PrefillRequest) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"request {preq.request_id} took longer than the server's request timeout "
            f"({self.request_timeout_s:g} s); its work was stopped")

    @staticmethod
    async def _sleep_within(seconds: float, deadline: float) -> None:
        await asyncio.sleep(max(0.0, min(seconds, deadline - asyncio.get_running_loop().time())))

    async def wait_for_replicas(self, preq: PrefillRequest, deadline: float,
                                preq_for_errors: PrefillRequest | None = None) -> float:
        """Wait until every phase ``preq`` needs has a replica that answers a ping, but not
        past ``deadline`` (the loop's clock; past it: the request's 504). Returns the
        seconds waited. While a phase has lost all its replicas, Serve's handle either
        queues the ping or fails it on a replica that is gone; either way this asks again
        until a replacement answers."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        phases = [self.decode] if self._prefills_locally(preq) else [self.prefill, self.decode]
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise self._timeout(preq_for_errors or preq)
            answered = await asyncio.gather(*(_answers_ping(h, min(left, REPLICA_PING_S))
                                              for h in phases))
            if all(answered):
                return loop.time() - start
            await self._sleep_within(REPLICA_POLL_S, deadline)

    def _prefills_locally(self, preq: PrefillRequest) -> bool:
        return (self.prefill is None or preq.num_tokens < self.local_prefill_threshold
                or self._busy_prefill_skipped(preq))

    def _is_short(self, preq: PrefillRequest) -> bool:
        return preq.num_tokens < self.local_prefill_when_busy

    def _busy_prefill_skipped(self, preq: PrefillRequest) -> bool:
        """A short prompt that the backed-up prefill phase would keep waiting longer than
        the decode replicas would: they prefill it, in their decode steps."""
        if not self._is_short(preq) or self.prefill_backlog_tokens < self.prefill_busy_tokens:
            return False
        longer = self.prefill_backlog_tokens - self.short_backlog_tokens
        # what the longer prompts there make it wait: a few layers of the pass under way
        # where passes pause for short prompts, else that pass and the chunk that fills its own
        longer_ahead = (min(longer, self.prefill_busy_tokens) // 4 if self.prefill_preempts
                        else min(longer, 2 * self.prefill_busy_tokens))
        ahead_there = self.short_backlog_tokens + longer_ahead
        return self.local_backlog_tokens < ahead_there

    async def reserve_kv(self, preq: PrefillRequest, trace: RequestTrace | None = None
                         ) -> Reservation:
        """Room in the KV budget for ``preq``'s package (waits while there is none; the
        wait is recorded in ``trace``). Without a budget, a reservation that holds nothing."""
        if self.kv_budget is None:
            return Reservation(None, 0)
        reservation = await self.kv_budget.reserve(preq.num_tokens * self.kv_bytes_per_token)
        if trace is not None:
            trace.kv_budget_wait_s += reservation.wait_s
        return reservation

    async def shared_prefill(self, preq: PrefillRequest,
                             trace: RequestTrace | None = None) -> SharedPackage | None:
        """``n > 1``: prefill the prompt once, a first token per answer, and return the
        package's ref for every answer's first attempt (``generate([ref], k)``). A prompt
        prefilled locally is prefilled by a decode replica (or the colocated server), whose
        package the answers read the same way. None when that phase cannot be reached: each
        answer then goes its own way, with retries. The package holds its room in the KV
        budget until every answer's stream has ended, wherever it was made (it is in an
        object store either way): the caller releases it then
        (``SharedPackage.reservation``)."""
        local = self._prefills_locally(preq)
        phase = self.decode if local else self.prefill
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        try:
            reservation = await asyncio.wait_for(self.reserve_kv(preq, trace),
                                                 self.request_timeout_s)
        except asyncio.TimeoutError:
            raise self._timeout(preq) from None
        call = phase.make_kv_package.remote(preq)
        try:
            ref = await asyncio.wait_for(call._to_object_ref(),
                                         max(0.0, deadline - loop.time()))
            return SharedPackage(ref, reservation, local)
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
            reservation.release()
            call.cancel()
            raise self._timeout(preq) from None
        except Exception as exc:
            reservation.release()
            call.cancel()
            if not is_retryable(exc):
                raise
            logger.warning("request %s: shared prefill failed (%s); each answer prefills "
                           "on its own", preq.request_id, type(unwrap_error(exc)).__name__)
            return None
        except BaseException:
            reservation.release()
            call.cancel()
            raise

    async def prefill_then_decode(self, preq: PrefillRequest, trace: RequestTrace,
                                  shared: tuple[SharedPackage, int] | None = None,
                                  ) -> AsyncIterator[TokenEvent]:
        """One attempt: the prefill replica makes the KV package and the ingress keeps only
        its ObjectRef; the decode replica resolves the ref on its own node and streams the
        tokens. Short prompts (and the colocated app) are prefilled on the decode replica.
        ``shared`` (a package made for several answers, and which answer this is) skips the
        prefill: every answer's stream reads the one object. A package that goes through
        the object store holds its room in the KV budget until the stream ends: Ray keeps a
        task's argument objects until the task finishes, and the decode stream is that
        task."""
        ref: ray.ObjectRef | None = None
        prefill_call = None
        held: Reservation | None = None  # a shared package's is released by the caller
        backlog: Backlog | None = None  # this attempt's tokens in a backlog count
        feed = self.feeds if shared is None else None  # an answer of n: its own stream
        fed = {"feed": feed.id} if feed is not None else {}
        if shared is not None:
            package, choice = shared
            ref = package.ref
            stream = self.decode.options(stream=True).generate.remote([ref], choice)
        elif self._prefills_locally(preq):
            if self.prefill is not None and preq.num_tokens >= self.local_prefill_threshold:
                self.local_when_busy += 1
                trace.prefill_busy_backlog = self.prefill_backlog_tokens
            backlog = Backlog(self, preq.num_tokens, local=True, short=False)
            stream = self.decode.options(stream=True).generate_local.remote(preq, **fed)
        else:
            held = await self.reserve_kv(preq, trace)
            backlog = Backlog(self, preq.num_tokens, local=False, short=self._is_short(preq))
            try:
                prefill_call = self.prefill.make_kv_package.remote(preq)
                ref = await prefill_call._to_object_ref()
            except BaseException:
                held.release()
                backlog.drop()
                if prefill_call is not None:
                    prefill_call.cancel()  # client gone or timed out: drop the queued prompt
                raise
            # the list keeps Ray from resolving the ref here: decode resolves it on its node
            stream = self.decode.options(stream=True).generate.remote([ref], **fed)
        queue = feed.open(preq.request_id) if feed is not None else None
        try:
            async for item in stream:
                if isinstance(item, StreamStart):
                    self._record_start(item, trace, shared, ref)
                    ref = None  # decode holds the package: the ingress needs no ref
                    prefill_call = None
                    if backlog is not None:
                        backlog.drop()
                    if feed is not None and feed.started(item, preq.request_id):
                        async for event in fed_tokens(stream, queue):
                            yield event
                        return
                    continue
                yield item
        finally:
            if feed is not None:
                feed.close(preq.request_id)
            stream.cancel()
            if backlog is not None:
                backlog.drop()
            if held is not None:
                held.release()
            if prefill_call is not None:
                prefill_call.cancel()  # a prompt still queued for prefill is dropped

    def _record_start(self, item: StreamStart, trace: RequestTrace,
                      shared: tuple[SharedPackage, int] | None,
                      ref: ray.ObjectRef | None) -> None:
        """An attempt's stream started: what the trace keeps of it."""
        if shared is not None and shared[0].local:
            # the package was made on the decode side: no hop to report
            item = dataclasses.replace(item, local_prefill=True)
        trace.stream_start = item
        if trace.cached_tokens is None:
            trace.cached_tokens = item.cached_tokens
        trace.attempts += 1
        if trace.kv_locations is None and ref is not None:
            trace.kv_locations, trace.kv_object_size = self.locate(ref)

    def _next_attempt(self, exc: Exception, preq: PrefillRequest, attempt: int,
                      delivered: int) -> tuple[int, str]:
        """Count a retry of ``preq`` after the retryable ``exc``: the next attempt's number
        and the error's name; GenerationFailed once ``max_retries`` are spent."""
        error = type(unwrap_error(exc)).__name__
        if attempt >= self.max_retries:
            raise GenerationFailed(
                f"request {preq.request_id} failed after {attempt} retries: {error}") from exc
        self.retries += 1
        logger.warning("request %s: %s; retry %d/%d with %d tokens delivered",
                       preq.request_id, error, attempt + 1, self.max_retries, delivered)
        return attempt + 1, error

    async def resumable_stream(self, preq: PrefillRequest, trace: RequestTrace,
                               shared: tuple[SharedPackage, int] | None = None,
                               ) -> AsyncIterator[TokenEvent]:
        """The token stream of ``preq``, surviving replica and node failures and bounded in
        time.

        When a prefill or decode replica (or its node, or the KV object) is lost, the request
        is prefilled again with the prompt plus the tokens already delivered and resumes on
        another decode replica: sampling continues at the same output index, so the client
        sees no missing and no duplicated token (greedy: the undisturbed text). After
        ``max_retries`` re-runs, or past ``request_timeout_s``, it ends with an error.
        ``shared`` serves the first attempt from a package made for several answers.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        delivered: list[int] = []
        attempt = 0
        current = preq
        while True:
            events = self.prefill_then_decode(current, trace, shared).__aiter__()
            shared = None  # a retry prefills this answer alone
            try:
                while True:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise TimeoutError
                    try:
                        event = await asyncio.wait_for(events.__anext__(), remaining)
                    except StopAsyncIteration:
                        return
                    if event.token_id is not None:
                        delivered.append(event.token_id)
                    if event.decode_queue_s is not None and trace.decode_queue_s is None:
                        trace.decode_queue_s = event.decode_queue_s
                    yield event
                    if event.finish_reason is not None:
                        return
            except (TimeoutError, asyncio.TimeoutError):  # the same class from Python 3.11
                raise self._timeout(preq) from None
            except Exception as exc:
                if not is_retryable(exc):
                    raise
                attempt, error = self._next_attempt(exc, preq, attempt, len(delivered))
                current = resume_request(preq, delivered, attempt)
            finally:
                await events.aclose()
            # only a retry gets here: back off, then wait (within the deadline) until the
            # phases it needs answer again, so a phase that lost every replica costs the
            # time its replacements take to start, not the retry budget
            retry = {"at_s": round(trace.elapsed_s(), 3), "error": error,
                     "delivered": len(delivered)}
            trace.retries.append(retry)
            await self._sleep_within(self.retry_backoff_s * 2 ** (attempt - 1), deadline)
            retry["replica_wait_s"] = round(await self.wait_for_replicas(current, deadline,
                                                                         preq), 3)
