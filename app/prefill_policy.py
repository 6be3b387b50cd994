"""The prefill scheduling policy, torch-free: which prompts the next prefill pass takes, and
which prompt chunks ride in a decode step. The engine (``app.prefill.Prefiller``) calls it
with its jobs and the capacity planner's simulator (``planner/sim/``) with simulated
ones, so the planner predicts the schedule the engine runs
(``tests/unit/planner/test_shared_policy.py`` drives both with one arrival sequence).

A job is anything with ``remaining`` (prompt tokens still to compute), ``done`` (positions
whose KV exists: a cached prefix and the chunks computed so far) and ``arrived`` (when it was
queued, on the caller's clock). Callers hand in the candidates shortest remaining first
(ties by arrival); the policy never sorts, so a caller may keep them in order as it likes.

Which prompts share a pass (``plan_pass``, for ``Prefiller.plan_pass``):

* shortest remaining first: a chat that arrives while a document is being prefilled gets
  into the next pass, not behind the whole document;
* fairness: once a prompt has waited ``prefill_fairness_s``, every other pass is led by the
  longest-waiting such prompt, so a document keeps at least half the passes however many
  short prompts arrive;
* a pass computes at most ``prefill_chunk_tokens`` (padding included): rows share a pass
  while ``rows x longest chunk`` fits it (and ``prefill_token_budget``), rows stay within
  ``prefill_max_batch_size``, and padding wastes at most a quarter of the computed tokens
  (a 64-token chat is not padded to a 256-token chunk). Several documents do not share one
  long pass: a prompt that arrives waits for at most one pass of that size;
* a pass takes no more prompts once it holds ``prefill_batch_tokens`` (when set): each
  prompt in a pass waits for all of it, and where such a pass computes about as fast per
  token as a longer one (a CPU, ``serve_configs/local.yaml``: BENCHMARKS.md §4), a wave of
  eight chats is answered two at a time, not all of them after the whole wave's compute;
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# Padding may add at most this fraction of a pass's real tokens.
MAX_PADDING = 0.25
# A plan looks at most this many candidates past its head (the rows it can take are far
# fewer: prefill_max_batch_size), so a long queue costs a plan nothing more.
PLAN_SCAN = 64


class Job(Protocol):
    @property
    def remaining(self) -> int: ...

    @property
    def done(self) -> int: ...

    @property
    def arrived(self) -> float: ...


@dataclass(eq=False)
class PrefillPolicy:
    """One replica's prefill schedule: its bounds (``EngineConfig``'s ``prefill_*`` settings)
    and the one bit of state the fairness rule keeps."""

    chunk_tokens: int = 256  # prefill_chunk_tokens
    token_budget: int = 4096  # prefill_token_budget
    max_rows: int = 8  # prefill_max_batch_size
    batch_tokens: int | None = None  # prefill_batch_tokens
    fairness_s: float = 5.0  # prefill_fairness_s
    led_by_waiting: bool = False  # the last plan was led by an over-waited prompt

    @classmethod
    def from_config(cls, cfg: Any) -> PrefillPolicy:
        """From an ``EngineConfig`` (or anything with its ``prefill_*`` fields)."""
        return cls(chunk_tokens=cfg.prefill_chunk_tokens, token_budget=cfg.prefill_token_budget,
                   max_rows=cfg.prefill_max_batch_size, batch_tokens=cfg.prefill_batch_tokens,
                   fairness_s=cfg.prefill_fairness_s)

    @property
    def pass_tokens(self) -> int:
        """What one pass computes at most: ``min(token_budget, chunk_tokens)``."""
        return min(self.token_budget, self.chunk_tokens)

    def chunk_of(self, job: Job) -> int:
        return min(job.remaining, self.chunk_tokens)

    def extra_lane_takes(self, job: Job) -> bool:
        """A prefill replica's extra lanes (``prefill_lanes`` > 1) take long prompts only:
        at least half a chunk left."""
        return 2 * job.remaining >= self.chunk_tokens

    def full(self, tokens: int) -> bool:
        """A pass (or a step's chunks) holding ``tokens`` takes no more prompts
        (``prefill_batch_tokens``)."""
        return self.batch_tokens is not None and tokens >= self.batch_tokens

    def head(self, oldest: Job, shortest: Job, now: float) -> Job:
        """The job that leads the next plan: every other time the longest-waiting one once it
        has waited ``fairness_s``, else the shortest remaining."""
        if now - oldest.arrived > self.fairness_s and not self.led_by_waiting:
            self.led_by_waiting = True
            return oldest
        self.led_by_waiting = False
        return shortest

    def fits(self, rows: Sequence[Job]) -> bool:
        """``rows`` can share one padded pass: every chunk padded to the longest stays within
        the pass and adds at most ``MAX_PADDING`` of the real tokens; every past padded to
        the longest (masked) stays within ``token_budget``."""
        chunks = [self.chunk_of(j) for j in rows]
        padded = len(rows) * max(chunks)
        if padded > self.pass_tokens or padded - sum(chunks) > MAX_PADDING * sum(chunks):
            return False
        pasts = [j.done for j in rows]
        return len(rows) * max(pasts) - sum(pasts) <= self.token_budget

    def plan_pass(self, head: Job, by_remaining: Iterable[Job]) -> list[Job]:
        """The jobs of the next pass of its own: ``head``, then candidates (shortest
        remaining first) while they fit, up to ``max_rows`` or ``batch_tokens``."""
        rows, tokens = [head], self.chunk_of(head)
        for scanned, job in enumerate(by_remaining):
            if len(rows) >= self.max_rows or self.full(tokens) or scanned > PLAN_SCAN:
                break
            if job is not head and self.fits([*rows, job]):
                rows.append(job)
                tokens += self.chunk_of(job)
        return rows

    def plan_chunks(self, head: Job, by_remaining: Iterable[Job],
                    decode_rows: int) -> tuple[list[Job], list[int]]:
        """The chunks that join a decode step of ``decode_rows`` rows in one mixed pass: at
        most one pass's tokens, decode rows included, but at least a quarter of that for the
        chunks (a full decode batch never starves the prompts); ``head`` first, then the
        candidates, each up to ``chunk_tokens`` of what is left, laid end to end (no
        padding). Returns the rows and their chunk sizes."""
        left = max(self.pass_tokens - decode_rows, self.pass_tokens // 4, 1)
        rows: list[Job] = []
        sizes: list[int] = []
        for job in itertools.chain((head,), by_remaining):
            if left <= 0 or len(rows) >= self.max_rows or self.full(sum(sizes)):
                break
            if job is head and rows:
                continue
            n = min(self.chunk_of(job), left)
            rows.append(job)
            sizes.append(n)
            left -= n
        return rows, sizes
