"""Continuous-batching decode.

``Decoder`` is the synchronous core, driven by one thread: each ``step`` admits waiting
sequences (their KV packages are copied into free blocks of the paged KV pool), drops
cancelled ones, runs one forward pass over every running sequence and records one token per
sequence. A sequence that leaves hands its blocks back; nothing else moves.

Admission reserves each sequence's whole need (prompt + max_tokens, in blocks) against the KV
budget, so a running sequence always finds a free block when it grows and no sequence is ever
preempted; blocks themselves are taken only as the sequence fills them.

``app.decode_loop.DecodeLoop`` wraps it for asyncio: ``generate(package)`` is an async
iterator of tokens, the steps run in a worker thread, and adds/cancels are applied only
between steps.

Mixed batching (the colocated engine, ``mixed_batch``): a loop given a ``prefill_source``
takes that source's next prompt chunks into every step it runs (``Decoder.step(plan)``, one
forward pass for the decode rows and the chunks), so a running stream waits one pass per
token, never a separate prefill pass; when it has nothing to step, the source prefills on its
own.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from app.idle_cores import on_threads
from app.kv_cache import DEFAULT_BLOCK_SIZE, BlockAllocator
from app.kv_package import KVPackage
from app.messages import FinishReason
from app.model_runner import ModelRunner
from app.sampling import sample_tokens, token_logprobs
from app.sequence import Sequence, SequenceStatus
from app.structured import Grammars

if TYPE_CHECKING:
    from app.prefill import ChunkPlan

logger = logging.getLogger(__name__)


class PrefillSource(Protocol):
    """Prompts waiting for prefill on the decode loop's own engine (mixed batching: the
    colocated app's ``app.prefill_queue.PrefillQueue``). Called on the event loop, between
    steps."""

    def take_chunks(self, decode_rows: int) -> ChunkPlan | None:
        """The chunks that join the next step, of about ``decode_rows`` rows; None: none."""

    def chunks_done(self, plan: ChunkPlan, error: BaseException | None) -> None:
        """The step that carried ``plan`` ended (its packages in ``plan.packages``)."""

    def decode_idle(self) -> None:
        """The loop has nothing left to step: the source prefills on its own again."""


@dataclass(frozen=True, slots=True)
class DecoderStats:
    running: int
    waiting: int
    kv_tokens_used: int  # tokens the blocks in use hold (blocks in use x block size)
    kv_tokens_reserved: int  # tokens the running sequences may grow to (admission)
    kv_tokens_budget: int
    kv_tokens_live: int  # tokens the running sequences hold now (their KV lengths)


class Decoder:
    """The running batch. Not thread-safe: one thread calls ``step``."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        eos_token_ids: frozenset[int],
        max_batch_size: int,
        max_kv_tokens: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        grammars: Grammars | None = None,
        step_threads: int | None = None,
    ) -> None:
        self.runner = runner
        self.step_threads = step_threads  # a decode-only step's threads (decode_threads)
        self.grammars = grammars  # constrained answers' matchers (app.structured)
        self.eos_token_ids = eos_token_ids
        self.max_batch_size = max_batch_size
        self.max_kv_tokens = max_kv_tokens
        self.blocks = BlockAllocator(max(1, max_kv_tokens // block_size), block_size)
        self.cache = runner.make_kv_cache(self.blocks.num_blocks, block_size)
        self.waiting: deque[tuple[Sequence, KVPackage]] = deque()
        self.running: list[Sequence] = []
        self.reserved_blocks = 0  # sum of the running sequences' reservations
        self.steps = 0
        self.mixed_steps = 0  # passes that carried prompt chunks (ChunkPlan) too
        self._rejected: list[Sequence] = []

    # -- admission ------------------------------------------------------------------------

    def add(self, seq: Sequence, package: KVPackage) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append((seq, package))

    def _build_matcher(self, seq: Sequence) -> bool:
        """A constrained sequence's matcher, rebuilt past the tokens its stream has output
        (the first token, a resume's); False when its constraint cannot be had here."""
        constraint = seq.sampling.constraint
        if constraint is None:
            return True
        try:
            assert self.grammars is not None, "a constrained answer needs grammars"
            seq.matcher = self.grammars.matcher(constraint, seq.generated_token_ids,
                                                self.eos_token_ids)
        except Exception:
            logger.exception("request %s: its constraint failed on this replica",
                             seq.request_id)
            return False
        return True

    def _reservation(self, seq: Sequence) -> int:
        """Blocks ``seq`` may fill at most: prompt + max_tokens, within the context."""
        return self.blocks.blocks_for(min(seq.max_total_tokens, self.runner.max_model_len))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            seq, package = self.waiting[0]
            need = self._reservation(seq)
            if self.reserved_blocks + need > self.blocks.num_blocks:
                if not self.running:
                    # cannot fit even alone: admission control upstream should prevent this
                    self.waiting.popleft()
                    seq.finish(FinishReason.ERROR)
                    self._rejected.append(seq)
                    continue
                break
            self.waiting.popleft()
            if not self._build_matcher(seq):
                seq.finish(FinishReason.ERROR)  # its own answer fails; the batch goes on
                self._rejected.append(seq)
                continue
            self.reserved_blocks += need
            seq.blocks = self.blocks.allocate(self.blocks.blocks_for(package.seq_len))
            self.cache.write(seq.blocks, package.kv_tensor(self.runner.kv_device))
            seq.kv_len, seq.status = package.seq_len, SequenceStatus.RUNNING
            seq.joined_at = time.perf_counter()
            self.running.append(seq)

    def _grow(self, seq: Sequence) -> None:
        """A block for the position this step writes, when the sequence's blocks are full
        (always free: the sequence's reservation covers it)."""
        if seq.kv_len >= len(seq.blocks) * self.blocks.block_size:
            seq.blocks.extend(self.blocks.allocate(1))

    def _release(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch and hand its blocks back."""
        self.running.remove(seq)
        self.blocks.free(seq.blocks)
        self.reserved_blocks -= self._reservation(seq)
        seq.blocks = []

    def cancel(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                self._release(seq)
                seq.finish(FinishReason.CANCELLED)
                return seq
        for i, (seq, _) in enumerate(self.waiting):
            if seq.request_id == request_id:
                del self.waiting[i]
                seq.finish(FinishReason.CANCELLED)
                return seq
        return None

    # -- the step --------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self, prefill: ChunkPlan | None = None) -> list[Sequence]:
        """Admit, run one forward pass, sample. Returns the sequences that got a token
        (or finished without one) this step; their last token and status tell what happened.

        ``prefill``: prompt chunks that share this step's pass (mixed batching,
        ``ModelRunner.forward_mixed``); the plan is completed (its rows advance, its finished
        prompts get their packages) before this returns. A step without them runs on
        ``step_threads`` (sampling included: its torch operations would wake the rest)."""
        with on_threads(self.step_threads if prefill is None else None):
            return self._step(prefill)

    def _step(self, prefill: ChunkPlan | None) -> list[Sequence]:
        self._admit()
        rejected, self._rejected = self._rejected, []
        if not self.running and prefill is None:
            return rejected
        batch = list(self.running)
        for seq in batch:
            self._grow(seq)
        tables = [s.blocks for s in batch]
        tokens_in = [s.last_token for s in batch]
        positions = [s.kv_len for s in batch]
        if prefill is None:
            logits = self.runner.decode(self.cache, tables, tokens_in, positions)  # [B, V]
        else:
            start = time.perf_counter()
            chunks, past, into = prefill.inputs()
            logits, chunk_logits, kvs = self.runner.forward_mixed(
                self.cache, tables, tokens_in, positions, chunks, past, into)
            prefill.complete(chunk_logits, kvs, start)
            self.mixed_steps += 1
        if not batch:
            return rejected
        params = [s.sampling for s in batch]
        tokens = sample_tokens(
            logits,
            params,
            [s.next_step for s in batch],
            history=[s.prompt_token_ids + s.output_token_ids for s in batch]
            if any(p.repetition_penalty != 1.0 for p in params)
            else None,
            outputs=[s.generated_token_ids for s in batch]
            if any(p.counts_output for p in params)
            else None,
            eos_token_ids=self.eos_token_ids,
            matchers=[s.matcher for s in batch] if any(s.matcher for s in batch) else None,
        )
        self.steps += 1
        for seq, tok, lp in zip(batch, tokens, token_logprobs(logits, params, tokens),
                                strict=True):
            seq.kv_len += 1
            seq.last_logprobs = lp
            seq.append(tok, eos_token_ids=self.eos_token_ids,
                       max_model_len=self.runner.max_model_len)
        for seq in batch:
            if seq.is_finished:
                self._release(seq)
        return rejected + batch

    def fail_all(self, reason: FinishReason = FinishReason.ERROR) -> list[Sequence]:
        failed = [s for s in self.running] + [s for s, _ in self.waiting]
        for seq in list(self.running):
            self._release(seq)
        for seq in failed:
            seq.finish(reason)
        self.waiting.clear()
        return failed

    def stats(self) -> DecoderStats:
        bs = self.blocks.block_size
        return DecoderStats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_tokens_used=self.blocks.num_used * bs,
            kv_tokens_reserved=self.reserved_blocks * bs,
            kv_tokens_budget=self.blocks.num_blocks * bs,
            kv_tokens_live=sum(s.kv_len for s in self.running),
        )
