"""Discrete-event simulation of the split app and of the colocated baseline.

The simulated engine follows the app's code path by path:

* **Prefill replica** (``PrefillServer`` → ``PrefillQueue``, ``app.prefill.Prefiller``): a
  prompt joins its replica's queue starting from its cached prefix (``cached_len`` of its
  arrival: only the uncached suffix is computed). The replica runs pass after pass; each
  pass is planned by the engine's rule (``Prefiller.plan_pass``): shortest remaining first,
  except that every other pass is led by the longest-waiting prompt once one has waited
  ``prefill_fairness_s``; each row computes at most ``prefill_chunk_tokens`` of its prompt;
  rows share a pass while ``rows x longest chunk`` fits ``min(token_budget,
  prefill_chunk_tokens)``, padding stays within a quarter of the real tokens, the padded
  pasts within ``token_budget`` and rows within ``prefill_max_rows``. A pass costs
  ``prefill_chunk_s(rows, longest chunk, longest past)``. A prompt that arrives while a
  long one is being computed joins the next pass. A prompt's package leaves when its own
  last chunk ends. An idle queue waits ``batch_wait_s`` after a prompt wakes it.
* **Routing to prefill** (``PrefixAffinityRouter``): each prompt has a home replica
  (rendezvous hashing of its first tokens: uniform over replicas here, drawn from a fixed
  seed) and goes there unless the home holds more than ``affinity_imbalance`` requests
  more than the least loaded, which then gets it. ``prefill_routing="least_loaded"`` sends
  every prompt to the least loaded replica instead.
* **KV hop**: ``hop_s(prompt tokens x KV bytes per token)``, the whole prompt (cached part
  included); decode yields the first token the moment it holds the package (TTFT).
* **Several answers** (``n``): one prefill, then each answer is its own decode sequence on
  the least loaded decode replica, each with its own hop and its own KV (the prompt's KV
  held once per answer), all of the request's ``output_len`` tokens.
* **Decode replica** (``Decoder``): continuous batching; before each step it admits waiting
  sequences in order while the batch has a free row and the KV pool has room for the head
  of the queue (which, when it does not fit, holds back every sequence behind it). A step
  gives every running sequence one token and costs ``decode_ctx_s(batch, positions)``,
  ``positions`` being the KV its attention works over. ``kv_layout`` picks the engine:

  - ``"paged"`` (this engine: ``app.kv_cache``, ``app.decode``, ``app.paged_attention``):
    a pool of ``kv_budget_tokens // kv_block_tokens`` blocks (16 tokens, the engine's); a
    sequence reserves its prompt + max_tokens rounded up to whole blocks when it joins and
    gives them back when it ends. The step gathers each row's KV padded to the longest row
    (``rows x longest``) unless that would copy more than twice the positions the rows
    hold, and then exactly those (their sum): rows of alike lengths are charged as a padded
    batch, a long outlier row switches the step to the exact sum (whose one SDPA call also
    scores each row against the other rows' positions, masked: not charged).
  - ``"inplace"``: the same pool, every row attending exactly its own positions (a
    paged-attention kernel that reads blocks in place, as vLLM's does; the default of
    ``python -m planner search``, whose roofline GPU efficiencies are vLLM's).
  - ``"padded"``: the contiguous buffer the engine had before its paged pool, kept to replay
    runs of that engine: ``round_rows(rows) x round_capacity(capacity)`` tokens reserved
    (rows 1, 2, 4 then multiples of 4, positions in multiples of 128, capacity the longest
    prompt + max_tokens) and every row attending the longest row's positions.

  Not modelled: the engine's cap of a reservation at ``max_model_len``, and its refusal of a
  sequence whose reservation does not fit even an empty pool (here it runs alone).
* **Colocated replica** (``ColocatedServer``): one device does both, on one engine thread
  that runs one pass at a time in the order they were submitted. Under the ``interleave``
  policy (this app) the replica's prefill queue is the split's (same planner, same
  chunks) and its passes alternate with decode steps while both have work: every running
  stream waits for one prefill pass (one chunk) between two steps. The ``chunked`` policy
  (vLLM/Sarathi-style mixed passes, not what this app does) instead mixes up to
  ``chunk_tokens`` tokens of the oldest prompt into every decode step. An ``n > 1``
  request is prefilled once; each answer decodes on the least loaded replica (a KV hop
  when that is another replica).

A request is good when every one of its answers meets every SLO: its record carries the
worst answer's TTFT and TPOT and the last answer's end (``SimRecord``).

Requests are routed to the replica with the least outstanding work (Serve's power-of-two
choice is close to that), prefill as above. Latencies are measured from the client's send
time and the metrics are the load generator's own (``load_tests.metrics``), so a simulated
run and a real one are summarized by the same code.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from load_tests.metrics import RequestRecord, meets_slos, summarize, tpot
from load_tests.workloads import LengthDist, arrival_gaps
from planner.hardware import DeviceProfile

# The prefix cache's block (``app.prefix_cache.DEFAULT_BLOCK_TOKENS``): a prompt's cached
# prefix is a whole number of blocks and leaves at least one token to compute.
PREFIX_BLOCK_TOKENS = 16
# ``app.kv_cache.DEFAULT_BLOCK_SIZE``: tokens per block of the decode replica's KV pool.
KV_BLOCK_TOKENS = 16
# ``app.paged_attention._EXACT_OVER_PADDED``: a decode step gathers exactly (no padding) when
# the padded block would copy more than this many times the positions the rows hold.
EXACT_OVER_PADDED = 2
KV_LAYOUTS = ("paged", "inplace", "padded")
# ``app.prefill.MAX_PADDING``: padding may add at most this fraction of a pass's real tokens.
MAX_PADDING = 0.25
# Prompts the planner looks at after the head of a pass: the engine scans the whole queue,
# but past this many no row joins in practice (rows x chunk fills the pass long before).
_PLAN_SCAN = 64

# ---- workload ---------------------------------------------------------------------------


def cached_prefix(input_len: int, hit_rate: float, block: int = PREFIX_BLOCK_TOKENS) -> int:
    """Prompt tokens a prefix hit rate of ``hit_rate`` takes from the cache: whole blocks,
    at most all but the last token (``PrefixCache.match``)."""
    if hit_rate <= 0:
        return 0
    blocks = math.floor(hit_rate * input_len + 1e-9) // block
    return min(blocks, (input_len - 1) // block) * block


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds from the start
    input_len: int
    output_len: int  # tokens of each answer
    request_class: str = "sim"
    n: int = 1  # answers (one prefill, n decode sequences)
    cached_len: int = 0  # prompt tokens the prefix cache holds (not computed)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.cached_len < self.input_len:
            raise ValueError(f"cached_len must be in [0, input_len), got {self.cached_len}")

    def with_prefix_hit_rate(self, hit_rate: float) -> Arrival:
        return replace(self, cached_len=cached_prefix(self.input_len, hit_rate))


@dataclass(frozen=True, slots=True)
class Workload:
    """An open-loop arrival process with length distributions.

    ``prefix_hit_rate``: the fraction of each prompt's tokens the prefix cache holds (whole
    blocks; the rest is computed), e.g. a multi-turn chat resending its conversation.
    ``n``: answers per request, each ``output_len`` tokens long.
    """

    rate: float
    input_len: LengthDist
    output_len: LengthDist
    num_requests: int = 200
    burstiness: float = 1.0
    seed: int = 0
    prefix_hit_rate: float = 0.0
    n: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.prefix_hit_rate <= 1.0:
            raise ValueError(f"prefix_hit_rate must be in [0, 1], got {self.prefix_hit_rate}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    def arrivals(self) -> list[Arrival]:
        rng = random.Random(self.seed)
        gaps = arrival_gaps(self.rate, self.burstiness, rng)
        out, t = [], 0.0
        for i in range(self.num_requests):
            if i:
                t += next(gaps)
            n_in = self.input_len.sample(rng)
            out.append(Arrival(t, n_in, self.output_len.sample(rng), n=self.n,
                               cached_len=cached_prefix(n_in, self.prefix_hit_rate)))
        return out

    def with_rate(self, rate: float) -> Workload:
        return replace(self, rate=rate)


def load_trace(path: str | Path, run: int | None = None) -> list[list[Arrival]]:
    """Arrivals from a load-generator ``results.json`` (one list per run, from each request's
    send time and token counts) or a JSONL file of ``{"at", "input", "output"}`` lines
    (optional ``"n"``, answers, and ``"cached"``, prompt tokens held by the prefix cache)."""
    text = Path(path).read_text()
    if str(path).endswith(".jsonl"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [[Arrival(float(r["at"]), int(r["input"]), int(r["output"]),
                         str(r.get("class", "sim")), int(r.get("n", 1)),
                         int(r.get("cached", 0))) for r in rows]]
    data = json.loads(text)
    runs = data["runs"] if run is None else [data["runs"][run]]
    return [trace_of_run(r) for r in runs]


def trace_of_run(run: dict[str, Any]) -> list[Arrival]:
    out = []
    for r in run["requests"]:
        if r.get("prompt_tokens") is None or not r.get("output_tokens"):
            continue  # failed requests carry no lengths
        out.append(Arrival(float(r["sent_at"]), int(r["prompt_tokens"]),
                           int(r["output_tokens"]), str(r.get("class", "sim"))))
    return sorted(out, key=lambda a: a.at)


# ---- systems ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """The engine's bounds (``EngineConfig`` / ``AppArgs``; the defaults are
    ``EngineConfig``'s)."""

    max_batch_size: int = 16
    token_budget: int = 4096  # prefill_token_budget
    prefill_max_rows: int = 8  # prefill_max_batch_size
    batch_wait_s: float = 0.005  # prefill_batch_wait_s
    kv_layout: str = "paged"  # "paged" (this engine) | "inplace" | "padded" (KV_LAYOUTS)
    kv_block_tokens: int = KV_BLOCK_TOKENS  # the paged pool's block
    prefill_chunk_tokens: int = 256  # at most this many tokens per prefill pass
    prefill_fairness_s: float = 5.0  # a prompt that waited this long leads every other pass
    prefill_routing: str = "affinity"  # "affinity" (PrefixAffinityRouter) | "least_loaded"
    affinity_imbalance: int = 4  # PrefixAffinityRouter's imbalance

    def __post_init__(self) -> None:
        if self.prefill_routing not in ("affinity", "least_loaded"):
            raise ValueError(f"unknown prefill routing {self.prefill_routing!r}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV layout {self.kv_layout!r}; known: {KV_LAYOUTS}")
        if self.kv_block_tokens < 1:
            raise ValueError("kv_block_tokens must be >= 1")


@dataclass(frozen=True, slots=True)
class SplitSystem:
    prefill: DeviceProfile
    decode: DeviceProfile
    num_prefill: int = 1
    num_decode: int = 1
    limits: EngineLimits = field(default_factory=EngineLimits)

    @property
    def price_per_hour(self) -> float:
        return (self.num_prefill * self.prefill.price_per_hour
                + self.num_decode * self.decode.price_per_hour)

    def describe(self) -> str:
        p, d = self.prefill.name, self.decode.name
        return f"split {self.num_prefill}x{p} : {self.num_decode}x{d}"


@dataclass(frozen=True, slots=True)
class ColocatedSystem:
    device: DeviceProfile
    num_replicas: int = 1
    limits: EngineLimits = field(default_factory=EngineLimits)
    policy: str = "interleave"  # "interleave" (this app) | "chunked"
    chunk_tokens: int = 512

    def __post_init__(self) -> None:
        if self.policy not in ("interleave", "chunked"):
            raise ValueError(f"unknown colocated policy {self.policy!r}")

    @property
    def price_per_hour(self) -> float:
        return self.num_replicas * self.device.price_per_hour

    def describe(self) -> str:
        extra = f", chunked {self.chunk_tokens}" if self.policy == "chunked" else ""
        return f"colocated {self.num_replicas}x{self.device.name}{extra}"


System = SplitSystem | ColocatedSystem


# ---- the event loop ---------------------------------------------------------------------


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

    @property
    def remaining(self) -> int:
        return self.arrival.input_len - self.done


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


class _PrefillQueue:
    """One replica's prompts waiting for prefill and the engine's pass planner
    (``deployments.replica.PrefillQueue`` with ``app.prefill.Prefiller.plan_pass``)."""

    def __init__(self, device: DeviceProfile, limits: EngineLimits) -> None:
        self.device, self.limits = device, limits
        self.chunk_tokens = limits.prefill_chunk_tokens
        self.pass_tokens = min(limits.token_budget, limits.prefill_chunk_tokens)
        # live prompts by (remaining, queued_at, uid): shortest remaining first
        self._order: list[tuple[int, float, int, _Req]] = []
        self._by_age: deque[_Req] = deque()  # arrival order; finished ones dropped lazily
        self._led_by_waiting = False
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
        return min(r.remaining, self.chunk_tokens)

    def plan(self, now: float) -> list[_Req]:
        """The prompts of the next pass (``Prefiller.plan_pass``); [] when none waits."""
        if not self._order:
            return []
        while self._by_age[0].remaining == 0:
            self._by_age.popleft()
        oldest = self._by_age[0]
        if now - oldest.queued_at > self.limits.prefill_fairness_s and not self._led_by_waiting:
            head, self._led_by_waiting = oldest, True
        else:
            head, self._led_by_waiting = self._order[0][3], False
        rows, chunks, pasts = [head], [self.chunk_of(head)], [head.done]
        for scanned, (_, _, _, r) in enumerate(self._order):
            if len(rows) >= self.limits.prefill_max_rows or scanned > _PLAN_SCAN:
                break
            if r is head:
                continue
            c = self.chunk_of(r)
            padded = (len(rows) + 1) * max(max(chunks), c)
            if padded > self.pass_tokens:
                break  # every later prompt's chunk is at least as long: none fits either
            real = sum(chunks) + c
            if padded - real > MAX_PADDING * real:
                continue
            if (len(rows) + 1) * max(max(pasts), r.done) - sum(pasts) - r.done \
                    > self.limits.token_budget:
                continue
            rows.append(r)
            chunks.append(c)
            pasts.append(r.done)
        return rows

    def pass_s(self, rows: list[_Req]) -> float:
        """One pass: every row padded to the longest chunk, every past to the longest."""
        return self.device.prefill_chunk_s(len(rows), max(self.chunk_of(r) for r in rows),
                                           max(r.done for r in rows))

    def advance(self, rows: list[_Req]) -> list[_Req]:
        """The pass of ``rows`` ended: each computed its chunk. Returns the prompts it
        finished (their packages leave now)."""
        finished = []
        for r in rows:
            del self._order[bisect.bisect_left(self._order, self._key(r)[:3])]
            c = self.chunk_of(r)
            r.done += c
            self.tokens -= c
            if r.remaining:
                bisect.insort(self._order, self._key(r))
            else:
                finished.append(r)
        return finished


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

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.limits.max_batch_size:
            seq = self.waiting[0]
            if not self._fits(seq) and self.running:
                break
            self.running.append(self.waiting.popleft())
            self.reserved_blocks += self._reservation(seq)

    def attended(self) -> int:
        """KV positions the step's attention works over (``attended_positions``); each row
        holds its context plus the token the step writes."""
        return attended_positions([s.kv_len + 1 for s in self.running], self.limits.kv_layout)

    def step_cost(self) -> float:
        return self.device.decode_ctx_s(len(self.running), self.attended())

    def start_step(self, busy: _Busy, then: Callable[[], None]) -> bool:
        """Admit the waiting sequences and run one step, charged to ``busy``; ``then`` runs
        when it ends. False (and nothing scheduled) when no sequence is running."""
        self.admit()
        if not self.running:
            return False
        cost = self.step_cost()
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


class _SplitRun:
    """The split app's replicas on a clock: prefill passes, the KV hop, decode batches."""

    def __init__(self, sysm: SplitSystem, clock: _Clock, finish: Callable[[_Seq], None]) -> None:
        self.sysm, self.limits, self.clock, self.finish = sysm, sysm.limits, clock, finish
        self.prefill_busy = [_Busy() for _ in range(sysm.num_prefill)]
        self.decode_busy = [_Busy() for _ in range(sysm.num_decode)]
        self.prefills = [_PrefillQueue(sysm.prefill, sysm.limits)
                         for _ in range(sysm.num_prefill)]
        self.decoders = [_Decoder(sysm.decode, sysm.limits, clock, finish)
                         for _ in range(sysm.num_decode)]
        self.decoding = [False] * sysm.num_decode
        self.homes = random.Random(0)  # each prompt's rendezvous-hash home replica

    def schedule_arrivals(self, arrivals: Iterable[Arrival]) -> None:
        overhead = self.sysm.prefill.request_overhead_s
        for uid, a in enumerate(arrivals):
            r = _Req(a, a.at, uid)
            self.clock.at(a.at + overhead, lambda r=r: self.request_arrive(r))

    def busy_devices(self) -> list[tuple[DeviceProfile, _Busy]]:
        return ([(self.sysm.prefill, b) for b in self.prefill_busy]
                + [(self.sysm.decode, b) for b in self.decode_busy])

    def _route_prefill(self) -> int:
        qs = self.prefills
        least = min(range(len(qs)), key=lambda k: (len(qs[k]), qs[k].tokens))
        if self.limits.prefill_routing == "least_loaded" or len(qs) == 1:
            return least
        home = self.homes.randrange(len(qs))
        if len(qs[home]) - len(qs[least]) > self.limits.affinity_imbalance:
            return least
        return home

    def request_arrive(self, r: _Req) -> None:
        i = self._route_prefill()
        q = self.prefills[i]
        q.add(r, self.clock.now)
        if q.idle:
            q.idle = False
            self.clock.at(self.clock.now + self.limits.batch_wait_s,
                          lambda: self.prefill_start(i))

    def prefill_start(self, i: int) -> None:
        q = self.prefills[i]
        rows = q.plan(self.clock.now)
        if not rows:
            q.idle = True
            return
        cost = q.pass_s(rows)
        self.prefill_busy[i].prefill_s += cost
        self.clock.at(self.clock.now + cost, lambda: self.prefill_end(i, rows))

    def prefill_end(self, i: int, rows: list[_Req]) -> None:
        """Each prompt this pass finished leaves; each answer hops to decode on its own."""
        dev = self.sysm.prefill
        for r in self.prefills[i].advance(rows):
            hop = dev.hop_s(r.arrival.input_len * dev.kv_bytes_per_token)
            for s in _answers(r):
                self.clock.at(self.clock.now + hop, lambda s=s: self.decode_arrive(s))
        self.prefill_start(i)

    def decode_arrive(self, s: _Seq) -> None:
        if s.first_token(self.clock.now):
            self.finish(s)
            return
        j = min(range(len(self.decoders)), key=lambda k: self.decoders[k].load)
        self.decoders[j].waiting.append(s)
        if not self.decoding[j]:
            self.decoding[j] = True
            # after the other events of this instant: sequences that arrive together
            # join the same first step
            self.clock.at(self.clock.now, lambda: self.decode_step(j))

    def decode_step(self, j: int) -> None:
        if not self.decoders[j].start_step(self.decode_busy[j], lambda: self.decode_step(j)):
            self.decoding[j] = False


class _ColocatedRun:
    """The colocated replicas on a clock: one device per replica alternates prefill passes
    with decode steps (``interleave``) or mixes prompt chunks into every step
    (``chunked``)."""

    def __init__(self, sysm: ColocatedSystem, clock: _Clock,
                 finish: Callable[[_Seq], None]) -> None:
        self.sysm, self.limits, self.device = sysm, sysm.limits, sysm.device
        self.clock, self.finish = clock, finish
        n = sysm.num_replicas
        self.busy = [_Busy() for _ in range(n)]
        self.prefills = [_PrefillQueue(sysm.device, sysm.limits) for _ in range(n)]
        self.mixed_queues: list[deque[_Req]] = [deque() for _ in range(n)]  # chunked
        self.decoders = [_Decoder(sysm.device, sysm.limits, clock, finish) for _ in range(n)]
        self.active = [False] * n
        self.ready_at = [0.0] * n  # interleave: the prefill loop's wake-up wait ends
        self.last_was_prefill = [False] * n

    def schedule_arrivals(self, arrivals: Iterable[Arrival]) -> None:
        overhead = self.device.request_overhead_s
        for uid, a in enumerate(arrivals):
            r = _Req(a, a.at, uid)
            self.clock.at(a.at + overhead, lambda r=r: self.request_arrive(r))

    def busy_devices(self) -> list[tuple[DeviceProfile, _Busy]]:
        return [(self.device, b) for b in self.busy]

    def _waiting_prompts(self, k: int) -> int:
        return len(self.prefills[k]) + len(self.mixed_queues[k])

    def request_arrive(self, r: _Req) -> None:
        n = len(self.decoders)
        i = min(range(n), key=lambda k: self.decoders[k].load + self._waiting_prompts(k))
        now = self.clock.now
        if self.sysm.policy == "chunked":
            r.done = r.arrival.cached_len
            self.mixed_queues[i].append(r)
            if not self.active[i]:
                self.active[i] = True
                self.clock.at(now + self.limits.batch_wait_s, lambda: self.next_pass(i))
            return
        q = self.prefills[i]
        q.add(r, now)
        if q.idle:
            q.idle = False
            self.ready_at[i] = now + self.limits.batch_wait_s
            self.clock.at(self.ready_at[i], lambda: self._wake(i))

    def _wake(self, i: int) -> None:
        if not self.active[i]:
            self.active[i] = True
            self.next_pass(i)

    def next_pass(self, i: int) -> None:
        """What replica ``i`` runs next."""
        if self.sysm.policy == "chunked":
            if self.mixed_queues[i]:
                self._mixed_pass(i)
            elif not self.decoders[i].start_step(self.busy[i], lambda: self.next_pass(i)):
                self.active[i] = False
            return
        # interleave: the engine thread runs what was submitted first; while both loops
        # have work, a prefill pass and a decode step take turns
        q = self.prefills[i]
        prefill_ready = len(q) > 0 and self.clock.now >= self.ready_at[i]
        if prefill_ready and not self.last_was_prefill[i]:
            self._prefill_pass(i)
        elif self.decoders[i].start_step(self.busy[i], lambda: self.next_pass(i)):
            self.last_was_prefill[i] = False
        elif prefill_ready:
            self._prefill_pass(i)
        else:
            self.active[i] = False  # a prompt still in its wake-up wait restarts it

    def _answers_out(self, i: int, r: _Req) -> None:
        """A prompt's prefill ended on replica ``i``: its answer decodes there (``n = 1``) or
        each answer on the least loaded replica, through the object store."""
        for s in _answers(r):
            j = i
            if r.arrival.n > 1:
                j = min(range(len(self.decoders)), key=lambda k: (self.decoders[k].load, k != i))
            if j == i:
                self._to_decode(j, s)
            else:
                hop = self.device.hop_s(r.arrival.input_len * self.device.kv_bytes_per_token)
                self.clock.at(self.clock.now + hop, lambda j=j, s=s: self._to_other(j, s))

    def _to_decode(self, i: int, s: _Seq) -> None:
        if s.first_token(self.clock.now):
            self.finish(s)
        else:
            self.decoders[i].waiting.append(s)

    def _to_other(self, j: int, s: _Seq) -> None:
        self._to_decode(j, s)
        if not self.active[j]:
            self.active[j] = True
            self.next_pass(j)

    # -- interleave ---------------------------------------------------------------------------

    def _prefill_pass(self, i: int) -> None:
        q = self.prefills[i]
        rows = q.plan(self.clock.now)
        cost = q.pass_s(rows)
        self.busy[i].prefill_s += cost
        self.last_was_prefill[i] = True
        self.clock.at(self.clock.now + cost, lambda: self._after_prefill_pass(i, rows))

    def _after_prefill_pass(self, i: int, rows: list[_Req]) -> None:
        q = self.prefills[i]
        for r in q.advance(rows):
            self._answers_out(i, r)
        if not len(q):
            q.idle = True
        self.next_pass(i)

    # -- chunked ------------------------------------------------------------------------------

    def _mixed_pass(self, i: int) -> None:
        # one mixed pass: every running sequence decodes, the oldest prompt advances by up
        # to chunk_tokens (prompts progress one after another)
        dec = self.decoders[i]
        dec.admit()
        r = self.mixed_queues[i][0]
        chunk = min(self.sysm.chunk_tokens, r.remaining)
        cost = self._mixed_pass_s(dec, chunk, r.done)
        self.busy[i].prefill_s += cost
        self.clock.at(self.clock.now + cost, lambda: self._after_mixed_pass(i, r, chunk))

    def _mixed_pass_s(self, dec: _Decoder, chunk: int, past: int) -> float:
        """A prompt chunk of ``chunk`` tokens after ``past`` positions plus a step of
        ``dec``'s running sequences in one pass: compute and memory terms add up."""
        dev = self.device
        p_compute = dev.prefill.compute(chunk, chunk * (chunk + 2 * past))
        p_memory = dev.prefill.memory(chunk, 0.0) - dev.prefill.memory.c0
        if dec.running:
            b, ctx_tokens = len(dec.running), dec.attended()
            d_compute = dev.decode.compute(b, ctx_tokens)
            d_memory = dev.decode.memory(b, ctx_tokens)
        else:
            d_compute, d_memory = 0.0, dev.prefill.memory.c0
        return dev.decode.overhead_s + max(p_compute + d_compute, p_memory + d_memory)

    def _after_mixed_pass(self, i: int, r: _Req, chunk: int) -> None:
        dec = self.decoders[i]
        if dec.running:
            dec.end_step()
        r.done += chunk
        if not r.remaining:
            self.mixed_queues[i].popleft()
            self._answers_out(i, r)
        self.next_pass(i)


class Simulation:
    """One run of a system on a list of arrivals."""

    def __init__(self, system: System, arrivals: Sequence[Arrival]) -> None:
        self.system = system
        self.arrivals = sorted(arrivals, key=lambda a: a.at)
        self.clock = _Clock()
        self.done: list[_Req] = []

    def run(self) -> SimResult:
        replicas: _SplitRun | _ColocatedRun
        if isinstance(self.system, SplitSystem):
            replicas = _SplitRun(self.system, self.clock, self._finish)
        else:
            replicas = _ColocatedRun(self.system, self.clock, self._finish)
        replicas.schedule_arrivals(self.arrivals)
        self.clock.run()
        return SimResult.build(self.system, self.done, replicas.busy_devices())

    def _finish(self, s: _Seq) -> None:
        s.req.finished += 1
        if s.req.finished == s.req.arrival.n:
            self.done.append(s.req)


# ---- results ----------------------------------------------------------------------------


@dataclass(slots=True)
class SimRecord(RequestRecord):
    """A simulated request. With several answers: ``output_tokens`` counts every answer's,
    ``ttft_s`` is the worst answer's first token, ``e2e_s`` the last answer's end and
    ``tpot_s`` the worst answer's TPOT, so the request meets an SLO exactly when every
    answer does."""

    answers: int = 1
    answer_tokens: int = 0  # each answer's output tokens
    worst_tpot_s: float | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.answers == 1:
            return tpot(self.e2e_s, self.ttft_s, self.output_tokens)
        return self.worst_tpot_s


def meets_all_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """``load_tests.metrics.meets_slos``, answer by answer for a request of several."""
    if isinstance(record, SimRecord) and record.answers > 1 and record.answer_tokens < 2:
        slos = {k: v for k, v in slos.items() if k != "tpot"}  # no answer has a TPOT
    return meets_slos(record, slos)


def _record(r: _Req) -> SimRecord:
    a = r.arrival
    firsts = [s.first_token_at for s in r.answers]
    ends = [s.finished_at for s in r.answers]
    assert None not in firsts and None not in ends
    tpots = [tpot(e - r.sent_at, f - r.sent_at, a.output_len)  # type: ignore[operator]
             for f, e in zip(firsts, ends, strict=True)]
    known = [t for t in tpots if t is not None]
    return SimRecord(
        a.request_class, r.sent_at, prompt_tokens=a.input_len,
        output_tokens=a.output_len * a.n, ttft_s=max(firsts) - r.sent_at,  # type: ignore[type-var]
        e2e_s=max(ends) - r.sent_at, ok=True,  # type: ignore[type-var]
        answers=a.n, answer_tokens=a.output_len, worst_tpot_s=max(known) if known else None)


@dataclass(slots=True)
class SimResult:
    system: str
    records: list[SimRecord]
    duration_s: float
    price_per_hour: float
    energy_j: float

    @classmethod
    def build(cls, system: System, done: Iterable[_Req],
              busy: list[tuple[DeviceProfile, _Busy]]) -> SimResult:
        done = sorted(done, key=lambda r: (r.sent_at, r.uid))
        records = [_record(r) for r in done]
        end = max((r.sent_at + (rec.e2e_s or 0.0) for r, rec in zip(done, records, strict=True)),
                  default=0.0)
        duration = max(end, 1e-9)
        energy = 0.0
        for dev, b in busy:
            idle = max(duration - b.prefill_s - b.decode_s, 0.0)
            energy += (b.prefill_s * dev.power_prefill_w + b.decode_s * dev.power_decode_w
                       + idle * dev.power_idle_w)
        return cls(system.describe(), records, duration, system.price_per_hour, energy)

    def summary(self, slos: dict[str, float] | None = None) -> dict[str, Any]:
        s = summarize(self.records, self.duration_s, slos)
        if slos and any(r.answers > 1 for r in self.records):
            good = sum(1 for r in self.records if meets_all_slos(r, slos))
            s.update(good_requests=good, goodput=good / self.duration_s,
                     good_fraction=good / len(self.records) if self.records else None)
        tokens = s["output_tokens"]
        cost = self.price_per_hour * self.duration_s / 3600.0
        s.update({
            "system": self.system,
            "price_per_hour": self.price_per_hour,
            "cost_per_m_output_tokens": cost / tokens * 1e6 if tokens else None,
            "energy_per_request_j": self.energy_j / len(self.records) if self.records else None,
            "energy_j": self.energy_j,
        })
        return s


def simulate(system: System, arrivals: Sequence[Arrival]) -> SimResult:
    return Simulation(system, arrivals).run()
