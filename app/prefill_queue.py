"""A prefill engine's queue of prompts and the passes that compute them (prefill lanes,
preemption for short prompts, mixed batching's chunks), with the fault-injection stall that
holds an engine's passes. No Ray: the phase deployments hold one each (a prefill replica, the
colocated server) and give it their metrics (``PassMetrics``, ``deployments.metrics``)."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from app.decode_loop import DecodeLoop
from app.engine_core import EngineCore
from app.kv_package import KVPackage
from app.messages import PrefillRequest
from app.prefill import ChunkPlan, PrefillJob
from app.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)


class _Histogram(Protocol):
    def observe(self, value: float) -> None: ...


class PassMetrics(Protocol):
    """What the queue records (``deployments.metrics.PrefillMetrics`` on a replica): each
    pass's prompts, tokens, seconds and packages, what waits, the prefix cache."""

    batch_size: _Histogram
    batch_tokens: _Histogram
    compute: _Histogram
    kv_bytes: _Histogram

    def record_waiting(self, tokens: int, requests: int) -> None: ...

    def record_prefix_cache(self, cache: PrefixCache) -> None: ...


# Stalls in force, by engine: when each ends. A second stall of a stalled engine moves its
# end (it does not queue another hold behind the first).
_STALL_ENDS: dict[int, float] = {}
_STALL_LOCK = threading.Lock()


def _stall(core: EngineCore, seconds: float) -> None:
    """Hold ``core``'s model from now until ``seconds`` from now (or a later stall's end)."""
    key = id(core)
    with _STALL_LOCK:
        holding = key in _STALL_ENDS
        _STALL_ENDS[key] = max(_STALL_ENDS.get(key, 0.0), time.monotonic() + seconds)
    if holding:
        return

    def hold() -> None:
        with core.runner.lock:
            while True:
                with _STALL_LOCK:
                    left = _STALL_ENDS[key] - time.monotonic()
                    if left <= 0:
                        del _STALL_ENDS[key]
                        return
                time.sleep(min(left, 0.5))

    threading.Thread(target=hold, name="fault-stall", daemon=True).start()


async def _stall_over(core: EngineCore) -> None:
    """Until ``core`` is not stalled: for a pass that runs without the runner's lock (a
    prefill lane beside another), which the stall's holder takes."""
    while id(core) in _STALL_ENDS:
        await asyncio.sleep(0.05)


class PrefillQueue:
    """Prompts waiting for prefill in one replica and the task that computes them: pass
    after pass (``Prefiller.plan_pass``: shortest remaining first, chunked, fair), each on
    the engine's thread, so a prompt that arrives during a long prompt's prefill joins the
    next pass. Counts what waits and what was computed.

    Mixed batching (``mix_into``, the colocated app): while the decode loop on the same
    engine has sequences, the queue runs no pass of its own on that thread; the loop takes
    the next chunks into each of its steps (``take_chunks``, ``Prefiller.plan_chunks``) and
    hands back what the step computed (``chunks_done``), and extra lanes, if any, still run
    long prompts' passes beside the steps. With nothing decoding, it runs its passes again.
    """

    def __init__(self, core: EngineCore, wait_s: float, metrics: PassMetrics,
                 on_batch: Callable[[int, int, float], None] | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), lanes: int = 1) -> None:
        self.core = core
        # passes at once, each on an engine lane of its own (prefill_lanes; where the
        # engine also decodes with mixed batching, lane 0 only while nothing decodes)
        self.lanes = lanes
        self._running: dict[int, asyncio.Task] = {}  # lane -> the pass task running there
        self.lane_passes = 0  # passes started on an extra lane (beside another)
        self.prefiller = core.make_prefiller(eos_token_ids)
        self.wait_s = wait_s  # how long a first arrival waits for company
        self.metrics = metrics
        self.on_batch = on_batch  # (prompts finished, prompt tokens computed, seconds) per pass
        self.jobs: list[PrefillJob] = []
        self._futures: dict[int, asyncio.Future] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.waiting_tokens = 0  # prompt tokens still to compute
        self.waiting_requests = 0
        self.completed = 0
        self.requests_total = 0  # prompts computed
        self.tokens_total = 0  # prompt tokens computed (cached ones not counted)
        self.compute_s_total = 0.0
        self.passes = 0
        self.mixed_passes = 0  # of those, decode steps that carried chunks
        self.preemptions = 0  # passes paused between layers for much shorter prompts
        self.decode: DecodeLoop | None = None  # mixed batching: the loop that takes chunks
        self._in_flight: set[int] = set()  # ids of the jobs in a pass or step under way

    def mix_into(self, loop: DecodeLoop) -> None:
        """Mixed batching: while ``loop`` has sequences, its steps carry this queue's
        chunks."""
        self.decode = loop
        loop.prefill_source = self

    def _free_jobs(self) -> list[PrefillJob]:
        return [j for j in self.jobs if id(j) not in self._in_flight]

    def take_chunks(self, decode_rows: int) -> ChunkPlan | None:
        """The decode loop's next step: the chunks it carries (none may be in a pass)."""
        plan = self.prefiller.plan_chunks(self._free_jobs(), decode_rows)
        if plan is not None:
            self._in_flight.update(id(j) for j in plan.rows)
        return plan

    def chunks_done(self, plan: ChunkPlan, error: BaseException | None) -> None:
        self._in_flight.difference_update(id(j) for j in plan.rows)
        if error is not None:
            for job in plan.rows:
                self._finish(job, exc=error)
            return
        self.mixed_passes += 1
        self._record_pass(plan.rows, plan.before, plan.packages, plan.elapsed)
        if self.lanes > 1:
            self._wake.set()  # its long prompts are free again for an extra lane

    def decode_idle(self) -> None:
        self._wake.set()

    async def enqueue(self, req: PrefillRequest) -> KVPackage:
        """Prefill one prompt (in passes shared with others); raises its validation error
        before it queues."""
        job = self.prefiller.new_job(req)
        future = asyncio.get_running_loop().create_future()
        self.jobs.append(job)
        self._futures[id(job)] = future
        self._track(job.remaining, +1)
        self._record_cache()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            return await future
        finally:
            job.cancelled = True  # a caller that gave up: its next pass is not computed
            if id(job) in self._futures:
                self._drop(job)
            self.completed += 1

    def _drop(self, job: PrefillJob) -> None:
        self.jobs.remove(job)
        del self._futures[id(job)]
        self._track(-job.remaining, -1)

    def _track(self, tokens: int, requests: int) -> None:
        self.waiting_tokens += tokens
        self.waiting_requests += requests
        self.metrics.record_waiting(self.waiting_tokens, self.waiting_requests)

    def _plan(self, jobs: list[PrefillJob]) -> list[PrefillJob]:
        """``Prefiller.plan_pass`` over ``jobs``; if planning fails, every queued prompt not
        in a pass fails with the error (never leave a caller waiting on a queue that
        stopped) and no rows come back."""
        try:
            return self.prefiller.plan_pass(jobs)
        except Exception as exc:
            logger.exception("prefill planning failed; failing the queued prompts")
            for job in [j for j in self.jobs if id(j) not in self._in_flight]:
                self._finish(job, exc=exc)
            return []

    async def _run(self) -> None:
        if self.lanes > 1:
            await self._run_lanes()
            return
        while True:
            if self.decode is not None and self.decode.busy:
                # the decode loop's steps take the chunks; it wakes us once it is idle
                self._wake.clear()
                await self._wake.wait()
                continue
            rows = self._plan(self._free_jobs())
            if not rows:  # then wait for the next prompt, not spin
                self._wake.clear()
                await self._wake.wait()
                await asyncio.sleep(self.wait_s)  # let prompts that arrive together share
                continue
            await self._pass(rows, self.core.config.prefill_preempt_layers or None)

    async def _run_lanes(self) -> None:
        """``lanes`` passes at once: whenever a lane is free and a prompt is not in a pass,
        the next pass starts there (``plan_pass``'s order), so a second document's chunk
        runs beside the first's instead of after it. The extra lanes take long prompts
        only (at least half a chunk left): short ones, which each wait for their whole pass,
        finish sooner one pass after another at full speed than two at once on shared cores
        (chats' TTFT p50 747 -> 1,170 ms when they took them too; `git show
        6105e59:BENCHMARKS.md`, "Tried, not kept"), so they go to lane 0, or wait there for
        a pause between layers (``_pass``)."""
        layers = self.core.config.prefill_preempt_layers or None
        while True:
            free = [i for i in range(self.lanes) if i not in self._running]
            if self.decode is not None and self.decode.busy:
                free = [i for i in free if i > 0]  # lane 0's thread steps, chunks riding
            rows: list[PrefillJob] = []
            if free:
                jobs = self._free_jobs()
                if free[0] > 0:  # an extra lane: long prompts only
                    jobs = [j for j in jobs if self.prefiller.policy.extra_lane_takes(j)]
                rows = self._plan(jobs) if jobs else []
            if rows:
                lane = free[0]
                self.lane_passes += lane > 0
                self._in_flight.update(id(j) for j in rows)  # before the task first runs
                task = asyncio.create_task(self._pass(rows, layers, lane))
                self._running[lane] = task
                task.add_done_callback(lambda _t, lane=lane: self._lane_done(lane))
                continue
            idle = not self._running
            self._wake.clear()
            await self._wake.wait()
            if idle:
                await asyncio.sleep(self.wait_s)  # let prompts that arrive together share

    def _lane_done(self, lane: int) -> None:
        self._running.pop(lane, None)
        self._wake.set()

    async def _pass(self, rows: list[PrefillJob], layers: int | None, lane: int = 0) -> None:
        """Run one pass over ``rows`` on engine lane ``lane``, ``layers`` layers at a time
        (None: whole). Between two runs of layers, prompts that arrived meanwhile and need
        at most half of this pass's tokens get a (whole) pass of their own first: a chat
        waits for a few layers of a document's chunk, not for all of them. One such pass
        per pause, so the long pass advances between any two. With several lanes, a pass
        runs alone (runner lock, idle cores) only while no other lane has one, and only
        lane 0's passes pause for short prompts."""
        before = [j.remaining for j in rows]
        self._in_flight.update(id(j) for j in rows)
        try:
            run = await self.core.run(self.prefiller.start_pass, rows, lane=lane)
            while True:
                advance = self.prefiller.advance
                if self.lanes > 1:
                    alone = lane == 0 and len(self._running) <= 1
                    if not alone:  # no runner lock: an injected stall holds this pass too
                        await _stall_over(self.core)
                    advance = functools.partial(advance, alone=alone)
                packages = await self.core.run(advance, run, layers, lane=lane)
                if packages is not None:
                    break
                if lane > 0:
                    continue  # short prompts go to lane 0 (``_run_lanes``)
                short = [j for j in self._free_jobs() if 2 * j.remaining <= run.tokens]
                first = self.prefiller.plan_pass(short) if short else []
                if first:
                    self.preemptions += 1
                    await self._pass(first, None, lane)
            self._in_flight.difference_update(id(j) for j in rows)
            self._record_pass(rows, before, packages, run.busy_s)
        except Exception as exc:  # the pass failed: its prompts fail, the queue goes on
            self._in_flight.difference_update(id(j) for j in rows)
            for job in rows:
                self._finish(job, exc=exc)

    def _record_pass(self, rows: list[PrefillJob], before: list[int],
                     packages: list[KVPackage | None], elapsed: float) -> None:
        computed = [b - j.remaining for j, b in zip(rows, before, strict=True)]
        # a prompt whose caller left during the pass was already taken off the count
        self._track(-sum(n for j, n in zip(rows, computed, strict=True)
                         if id(j) in self._futures), 0)
        tokens = sum(computed)
        finished = [p for p in packages if p is not None]
        self.passes += 1
        self.requests_total += len(finished)
        self.tokens_total += tokens
        self.compute_s_total += elapsed
        if self.on_batch is not None:
            self.on_batch(len(finished), tokens, elapsed)
        self.metrics.batch_size.observe(len(rows))
        self.metrics.batch_tokens.observe(tokens)
        self.metrics.compute.observe(elapsed)
        for job, pkg in zip(rows, packages, strict=True):
            if pkg is not None:
                self.metrics.kv_bytes.observe(pkg.kv_nbytes)
                self._finish(job, package=pkg)
        self._record_cache()

    def _finish(self, job: PrefillJob, package: KVPackage | None = None,
                exc: BaseException | None = None) -> None:
        future = self._futures.get(id(job))
        if future is None:
            return
        self._drop(job)
        if not future.done():
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(package)

    def _record_cache(self) -> None:
        cache = self.prefiller.prefix_cache
        if cache is not None:
            self.metrics.record_prefix_cache(cache)

    def thread_stats(self) -> dict[str, float]:
        """How the passes' threads went (``prefill_max_threads``), or nothing when off."""
        idle = self.prefiller.idle_cores
        stats = idle.stats() if idle is not None else {}
        if self.lanes > 1:
            stats["extra_lane_passes"] = self.lane_passes
        return stats

    def cache_stats(self) -> dict[str, float]:
        cache = self.prefiller.prefix_cache
        if cache is None:
            return {"prefix_cache": 0}
        return {"prefix_cache_blocks": len(cache), "prefix_cache_bytes": cache.bytes,
                "prefix_cache_hit_rate": cache.hit_rate,
                "prefix_cache_hit_tokens": cache.hit_tokens,
                "prefix_cache_queried_tokens": cache.queried_tokens,
                "prefix_cache_evictions": cache.evictions}
