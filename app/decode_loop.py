"""The asyncio face of the continuous-batching :class:`~app.decode.Decoder`: ``generate(package)``
is an async iterator of tokens, the steps run on the engine's thread, and adds/cancels are
applied only between steps. Mixed batching: a loop given a ``prefill_source`` takes that
source's next prompt chunks into every step it runs (see ``app.decode``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from app.decode import Decoder, PrefillSource
from app.errors import QueueFullError
from app.kv_package import KVPackage
from app.messages import FinishReason, TokenEvent
from app.sequence import Sequence

if TYPE_CHECKING:
    from app.prefill import ChunkPlan

logger = logging.getLogger(__name__)


class DecodeLoop:
    """Asyncio face of a :class:`Decoder`: one background task steps it on ``executor``
    (the engine's thread).

    Adds and cancels are queued and applied by that task between steps, so the decoder is
    never touched while a step runs. ``max_waiting`` bounds the sequences that
    wait to join the batch; past it ``generate`` raises :class:`QueueFullError` at once.
    """

    def __init__(self, decoder: Decoder, *, max_waiting: int, fingerprint: str,
                 executor: Executor | None = None) -> None:
        self.decoder = decoder
        self.executor = executor  # the engine's thread, where every step runs
        self.max_waiting = max_waiting
        self.fingerprint = fingerprint
        self._pending_adds: list[tuple[Sequence, KVPackage]] = []
        self._pending_cancels: set[str] = set()
        self._queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.last_step_at = time.monotonic()
        self.step_started_at: float | None = None  # monotonic start of the running step
        self.step_times: deque[float] = deque(maxlen=256)
        # mixed batching: prompts whose chunks ride in this loop's steps (None: off)
        self.prefill_source: PrefillSource | None = None

    @property
    def busy(self) -> bool:
        """Sequences to step: running, waiting, or handed over and not yet applied."""
        return bool(self._pending_adds or self.decoder.has_work)

    @property
    def num_active(self) -> int:
        return len(self._queues)

    @property
    def num_waiting(self) -> int:
        return len(self._pending_adds) + len(self.decoder.waiting)

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            # a new task may run on a new event loop (an engine used from several
            # asyncio.run calls); the event must belong to the loop that waits on it
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="decode-loop")

    async def generate(self, package: KVPackage) -> AsyncIterator[TokenEvent]:
        """Stream a sequence's tokens, starting with prefill's first token at once.

        Closing the iterator early (client disconnect, stop string found upstream) cancels the
        sequence; its blocks are freed before the next step.
        """
        package.check_compatible(self.fingerprint, self.decoder.runner.layout)
        rid = package.request_id
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already decoding")
        seq = Sequence(
            request_id=rid,
            prompt_token_ids=package.prompt_ids,
            sampling=package.sampling,
            output_offset=package.output_offset,
            last_logprobs=package.first_logprobs,
        )
        seq.append(
            package.first_token,
            eos_token_ids=self.decoder.eos_token_ids,
            max_model_len=self.decoder.runner.max_model_len,
        )
        if seq.is_finished:
            yield TokenEvent(rid, package.first_token, seq.output_offset, seq.finish_reason,
                             logprobs=seq.last_logprobs)
            return
        if self.num_waiting >= self.max_waiting:
            raise QueueFullError(
                f"decode queue is full ({self.num_waiting} sequences waiting)", retry_after_s=1.0
            )
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._queues[rid] = queue
        seq.enqueued_at = time.perf_counter()
        self._pending_adds.append((seq, package))
        del package  # the decoder holds the only reference until it copies the KV in
        self._ensure_task()
        assert self._wakeup is not None
        self._wakeup.set()
        finished = False
        try:
            yield TokenEvent(rid, seq.output_token_ids[0], seq.output_offset,
                             logprobs=seq.last_logprobs)
            while True:
                event = await queue.get()
                finished = event.finish_reason is not None
                yield event
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self._pending_cancels.add(rid)
                if self._wakeup is not None:
                    self._wakeup.set()

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        cancels, self._pending_cancels = self._pending_cancels, set()
        for seq, package in adds:
            if seq.request_id in cancels:
                cancels.discard(seq.request_id)
                continue
            self.decoder.add(seq, package)
        for rid in cancels:
            self.decoder.cancel(rid)

    def _take_chunks(self) -> ChunkPlan | None:
        """Mixed batching: the prompt chunks that join the next step."""
        if self.prefill_source is None or not self.decoder.has_work:
            return None
        dec = self.decoder
        rows = min(dec.max_batch_size, len(dec.running) + len(dec.waiting))
        try:
            return self.prefill_source.take_chunks(rows)
        except Exception:  # the source's own failure must not stop the streams
            logger.exception("planning the prompt chunks of a decode step failed")
            return None

    def _chunks_done(self, plan: ChunkPlan | None, error: BaseException | None) -> None:
        if plan is None or self.prefill_source is None:
            return
        try:
            self.prefill_source.chunks_done(plan, error)
        except Exception:
            logger.exception("handing back the prompt chunks of a decode step failed")

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            if not (self._pending_adds or self._pending_cancels or self.decoder.has_work):
                if self.prefill_source is not None:
                    self.prefill_source.decode_idle()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            start = time.perf_counter()
            self._apply_pending()  # on the loop thread, while no step runs
            plan = self._take_chunks()
            self.step_started_at = time.monotonic()
            try:
                touched = await asyncio.get_running_loop().run_in_executor(
                    self.executor, self.decoder.step, plan)
            except Exception as exc:  # a failed step must not strand any stream
                logger.exception("decode step failed")
                self._chunks_done(plan, exc)
                for seq in self.decoder.fail_all():
                    self._deliver(TokenEvent(seq.request_id, None, seq.next_step,
                                             FinishReason.ERROR, error=str(exc)))
                continue
            finally:
                self.step_started_at = None
            self._chunks_done(plan, None)
            elapsed = time.perf_counter() - start
            self.last_step_at = time.monotonic()
            if touched:
                self.step_times.append(elapsed)
            for seq in touched:
                if seq.finish_reason is FinishReason.ERROR:
                    self._deliver(TokenEvent(seq.request_id, None, seq.next_step,
                                             FinishReason.ERROR,
                                             error="sequence does not fit the KV budget"))
                    continue
                reason = seq.finish_reason if seq.is_finished else None
                # the first token a decode step made (the prefill made the one before it)
                queued = seq.decode_queue_s if seq.num_output_tokens == 2 else None
                self._deliver(TokenEvent(seq.request_id, seq.last_token, seq.next_step - 1,
                                         reason, decode_queue_s=queued,
                                         logprobs=seq.last_logprobs))
            await asyncio.sleep(0)  # let consumers run between steps

    def _deliver(self, event: TokenEvent) -> None:
        queue = self._queues.get(event.request_id)
        if queue is not None:
            queue.put_nowait(event)

    def fail_streams(self, message: str) -> int:
        """End every open stream with an error event at once, without touching the decoder
        (which may be stuck in a step). Used when the replica declares itself unhealthy."""
        queues = list(self._queues.items())
        for rid, queue in queues:
            queue.put_nowait(TokenEvent(rid, None, -1, FinishReason.ERROR, error=message))
        return len(queues)

    def stalled_s(self) -> float:
        """How long the loop has been stuck: the age of a step still running, infinite when
        the loop task died with work left, else 0."""
        started = self.step_started_at
        if started is not None:
            return time.monotonic() - started
        has_work = bool(self._pending_adds or self.decoder.has_work)
        if has_work and self._task is not None and self._task.done():
            return float("inf")
        return 0.0

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
