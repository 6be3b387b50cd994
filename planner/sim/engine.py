"""One replica's engine as the simulator models it: the event clock, requests and answers, KV
accounting, the prefill queue (the engine's own policy) and the decoder."""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from planner.hardware import DeviceProfile
from planner.sim.constants import EXACT_OVER_PADDED, KV_BLOCK_TOKENS
from planner.sim.systems import EngineLimits
from planner.sim.workload import Arrival


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._ids = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._ids), fn))

    def run(self) -> None:
        while self._heap:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()


@dataclass(eq=False, slots=True)
class _Req:
    """One request: its prompt's way through prefill and its answers."""

    arrival: Arrival
    sent_at: float
    uid: int
    done: int = 0  # prompt positions whose KV exists (cached prefix + computed chunks)
    queued_at: float = 0.0  # when it joined its prefill queue (``PrefillJob.arrived``)
    answers: list[_Seq] = field(default_factory=list)
    finished: int = 0  # answers finished
    local: bool = False  # prefilled on the replica that decodes it (colocated, or split local)
    backlog: int = 0  # its tokens in a split backlog count, until its stream starts
    short: bool = False  # counted in the short backlog too

    @property
    def remaining(self) -> int:
        return self.arrival.input_len - self.done

    @property
    def arrived(self) -> float:  # app.prefill_policy.Job
        return self.queued_at


@dataclass(eq=False, slots=True)
class _Seq:
    """One answer: a decode sequence."""

    req: _Req
    first_token_at: float | None = None
    finished_at: float | None = None
    generated: int = 0  # output tokens produced so far (the first comes from prefill)

    @property
    def output_len(self) -> int:
        return self.req.arrival.output_len

    @property
    def kv_len(self) -> int:
        # KV held: the prompt plus every output token fed back so far
        return self.req.arrival.input_len + max(self.generated - 1, 0)

    @property
    def max_total(self) -> int:
        return self.req.arrival.input_len + self.output_len

    def first_token(self, now: float) -> bool:
        """Prefill's token reaches the decoder at ``now``; True when it was the only one."""
        self.first_token_at = now
        self.generated = 1
        if self.output_len <= 1:
            self.finished_at = now
            return True
        return False


def _answers(r: _Req) -> list[_Seq]:
    r.answers = [_Seq(r) for _ in range(r.arrival.n)]
    return r.answers


def _padded_kv_tokens(rows: int, capacity: int) -> int:
    """KV tokens the engine's old contiguous batch buffer reserved (``kv_layout="padded"``;
    ``ModelRunner.kv_tokens_for`` before the paged pool): rows 1, 2, 4 then multiples of 4,
    positions in multiples of 128."""
    rows = 1 << max(0, (rows - 1).bit_length()) if rows <= 4 else -(-rows // 4) * 4
    return rows * max(1, -(-capacity // 128)) * 128


def kv_blocks(tokens: int, block: int = KV_BLOCK_TOKENS) -> int:
    """Blocks that hold ``tokens`` tokens (``BlockAllocator.blocks_for``)."""
    return -(-tokens // block)


def pool_blocks(budget_tokens: int, block: int = KV_BLOCK_TOKENS) -> int:
    """Blocks in a decode replica's pool of ``budget_tokens`` (``Decoder.__init__``)."""
    return max(1, budget_tokens // block)


def gathers_exact(lengths: Sequence[int]) -> bool:
    """Whether the engine's decode step over rows of ``lengths`` positions gathers them
    exactly rather than padded to the longest (``PagedDecodeStep.build``)."""
    return len(lengths) * max(lengths) > EXACT_OVER_PADDED * sum(lengths)


def attended_positions(lengths: Sequence[int], kv_layout: str = "paged") -> int:
    """KV positions a decode step over rows of ``lengths`` positions works over: ``rows x
    longest`` for a padded batch, the rows' own positions (their sum) for an exact one."""
    if kv_layout == "inplace" or (kv_layout == "paged" and gathers_exact(lengths)):
        return sum(lengths)
    return len(lengths) * max(lengths)


@dataclass(slots=True)
class _Busy:
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass(slots=True)
class _Chunks:
    """The prompt part of one mixed step (``app.prefill.ChunkPlan``): the next ``sizes[k]``
    tokens of each prompt of ``rows``; empty when no prompt had tokens left."""

    rows: list[_Req] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


class _PrefillQueue:
    """One replica's prompts waiting for prefill, planned by the engine's own policy
    (``app.prefill_policy.PrefillPolicy``, which ``app.prefill.Prefiller`` calls too:
    ``plan_pass`` for a pass of its own, ``plan_chunks`` for the chunks of a mixed step);
    this class keeps the prompts in the policy's order as they come and go."""

    def __init__(self, device: DeviceProfile, limits: EngineLimits) -> None:
        self.device, self.limits = device, limits
        self.policy = limits.prefill_policy()
        # live prompts by (remaining, queued_at, uid): shortest remaining first
        self._order: list[tuple[int, float, int, _Req]] = []
        self._by_age: deque[_Req] = deque()  # arrival order; finished ones dropped lazily
        self.idle = True  # the queue's loop sleeps: the next prompt waits batch_wait_s
        self.tokens = 0  # prompt tokens still to compute

    def __len__(self) -> int:
        return len(self._order)

    @staticmethod
    def _key(r: _Req) -> tuple[int, float, int, _Req]:
        return (r.remaining, r.queued_at, r.uid, r)

    def add(self, r: _Req, now: float) -> None:
        r.queued_at, r.done = now, r.arrival.cached_len
        bisect.insort(self._order, self._key(r))
        self._by_age.append(r)
        self.tokens += r.remaining

    def chunk_of(self, r: _Req) -> int:
        return self.policy.chunk_of(r)

    def _candidates(self, busy: Collection[_Req]) -> Iterable[_Req]:
        return (r for _, _, _, r in self._order if r not in busy)

    def _head(self, now: float, busy: Collection[_Req] = ()) -> _Req | None:
        """The prompt that leads the next pass or step (``PrefillPolicy.head``). ``busy``:
        prompts in a pass under way (not planned again)."""
        while self._by_age and self._by_age[0].remaining == 0:
            self._by_age.popleft()
        oldest = next((r for r in self._by_age if r.remaining and r not in busy), None)
        if oldest is None:
            return None
        return self.policy.head(oldest, next(iter(self._candidates(busy))), now)

    def plan(self, now: float, busy: Collection[_Req] = ()) -> list[_Req]:
        """The prompts of the next pass (``PrefillPolicy.plan_pass``); [] when none waits.
        ``busy``: prompts in a pass under way on another lane (not planned again)."""
        head = self._head(now, busy)
        return [] if head is None else self.policy.plan_pass(head, self._candidates(busy))

    def plan_chunks(self, now: float, decode_rows: int, busy: Collection[_Req] = ()) -> _Chunks:
        """The chunks that ride in a decode step of ``decode_rows`` rows
        (``PrefillPolicy.plan_chunks``). ``busy``: prompts in a pass under way."""
        head = self._head(now, busy)
        if head is None:
            return _Chunks()
        rows, sizes = self.policy.plan_chunks(head, self._candidates(busy), decode_rows)
        return _Chunks(rows, sizes)

    def pass_s(self, rows: list[_Req], device: DeviceProfile | None = None) -> float:
        """One pass (on ``device``, default the queue's): every row padded to the longest
        chunk, every past to the longest."""
        return (device or self.device).prefill_chunk_s(
            len(rows), max(self.chunk_of(r) for r in rows), max(r.done for r in rows))

    def advance(self, rows: list[_Req], sizes: Sequence[int] | None = None) -> list[_Req]:
        """The pass of ``rows`` ended: each computed its chunk (``sizes``, or its next
        ``chunk_of``). Returns the prompts it finished (their packages leave now)."""
        finished = []
        for k, r in enumerate(rows):
            del self._order[bisect.bisect_left(self._order, self._key(r)[:3])]
            c = self.chunk_of(r) if sizes is None else sizes[k]
            r.done += c
            self.tokens -= c
            if r.remaining:
                bisect.insort(self._order, self._key(r))
            else:
                finished.append(r)
        return finished


def weighted_share(cores: float, weights: Sequence[float],
                   caps: Sequence[float] | None = None) -> float:
    """The share of ``cores`` the first of several CPU consumers gets where the OS shares
    the cores in proportion to their ``weights``, none getting more than its cap (``caps``;
    default one core: a thread) and what one cannot use going to the others."""
    caps = [1.0] * len(weights) if caps is None else caps
    assert weights and len(caps) == len(weights) and all(w > 0 for w in weights)
    left, rest = cores, set(range(len(weights)))
    while True:
        total = sum(weights[k] for k in rest)
        capped = [k for k in rest if left * weights[k] / total >= caps[k]]
        if not capped:
            return left * weights[0] / total
        if 0 in capped:
            return caps[0]
        for k in capped:
            left -= caps[k]
            rest.discard(k)


class _Decoder:
    """One decode batch (``app.decode.Decoder``) on a device."""

    def __init__(self, device: DeviceProfile, limits: EngineLimits, clock: _Clock,
                 finish: Callable[[_Seq], None]) -> None:
        self.device = device
        self.limits = limits
        self.clock = clock
        self.finish = finish
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.reserved_blocks = 0  # the running sequences' reservations in the paged pool

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def _reservation(self, s: _Seq) -> int:
        """Blocks a sequence reserves in the paged pool: prompt + max_tokens, whole blocks."""
        return kv_blocks(s.max_total, self.limits.kv_block_tokens)

    def _fits(self, seq: _Seq) -> bool:
        """Whether ``seq`` may join the running sequences under the KV budget."""
        budget = self.device.kv_budget_tokens
        if self.limits.kv_layout == "padded":
            capacity = max([s.max_total for s in self.running] + [seq.max_total])
            return _padded_kv_tokens(len(self.running) + 1, capacity) <= budget
        blocks = pool_blocks(budget, self.limits.kv_block_tokens)
        return self.reserved_blocks + self._reservation(seq) <= blocks

    def admit(self, limit: int | None = None) -> None:
        """``limit``: of the waiting sequences, only the first so many may join."""
        limit = len(self.waiting) if limit is None else limit
        while self.waiting and len(self.running) < self.limits.max_batch_size and limit > 0:
            limit -= 1
            seq = self.waiting[0]
            if not self._fits(seq) and self.running:
                break
            self.running.append(self.waiting.popleft())
            self.reserved_blocks += self._reservation(seq)

    def attended(self) -> int:
        """KV positions the step's attention works over (``attended_positions``); each row
        holds its context plus the token the step writes."""
        return attended_positions([s.kv_len + 1 for s in self.running], self.limits.kv_layout)

    def step_cost(self, share: float = 1.0) -> float:
        """A step's time, its engine on ``share`` of a core (the serving stack's part as
        measured)."""
        return self.device.decode_ctx_s(len(self.running), self.attended(), share)

    def start_step(self, busy: _Busy, then: Callable[[], None], share: float = 1.0) -> bool:
        """Admit the waiting sequences and run one step (its engine on ``share`` of a core),
        charged to ``busy``; ``then`` runs when it ends. False (and nothing scheduled) when
        no sequence is running."""
        self.admit()
        if not self.running:
            return False
        cost = self.step_cost(share)
        busy.decode_s += cost
        self.clock.at(self.clock.now + cost, lambda: (self.end_step(), then()))
        return True

    def end_step(self) -> None:
        now = self.clock.now
        still = []
        for s in self.running:
            s.generated += 1
            if s.generated >= s.output_len:
                s.finished_at = now
                self.reserved_blocks -= self._reservation(s)
                self.finish(s)
            else:
                still.append(s)
        self.running = still
