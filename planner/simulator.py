"""Discrete-event simulation of the split app and of the colocated baseline.

The simulated engine follows the app's code path by path:

* **Prefill replica** (``PrefillServer``): requests queue; when the replica is free it takes
  the queue head in arrival order up to ``token_budget`` tokens (``@serve.batch`` with a token
  ``batch_size_fn``, a prompt longer than the budget weighing the whole budget), waits the
  batch timeout, then runs the batch as right-padded passes of at most ``prefill_max_rows``
  rows and ``rows x longest <= token_budget`` (``app.prefill.plan_batches``). Every package
  of the batch is returned when the last pass ends.
* **KV hop**: ``hop_s(prompt tokens x KV bytes per token)``; decode yields the first token the
  moment it holds the package (TTFT).
* **Decode replica** (``Decoder``): continuous batching; before each step it admits waiting
  sequences in order while the batch has a free row and the KV budget holds (the engine's
  buffer is ``round_rows(rows) x round_capacity(capacity)`` tokens, capacity the longest prompt +
  max_tokens; a paged engine holds exactly the tokens used). A step costs ``decode_s(batch,
  longest context)`` and gives every running sequence one token.
* **Colocated replica** (``ColocatedServer``): one device does both; a waiting prefill batch
  runs between two decode steps and every running stream waits for it (``interleave``). The
  ``chunked`` policy (vLLM/Sarathi-style, not what this app does) instead mixes up to
  ``chunk_tokens`` prompt tokens into every decode step.

Requests are routed to the replica with the least outstanding work (Serve's power-of-two
choice is close to that). Latencies are measured from the client's send time and the metrics
are the load generator's own (``load_tests.metrics``), so a simulated run and a real one are
summarized by the same code.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from load_tests.metrics import RequestRecord, summarize
from load_tests.workloads import LengthDist, arrival_gaps
from planner.hardware import DeviceProfile

# ---- workload ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds from the start
    input_len: int
    output_len: int
    request_class: str = "sim"


@dataclass(frozen=True, slots=True)
class Workload:
    """An open-loop arrival process with length distributions."""

    rate: float
    input_len: LengthDist
    output_len: LengthDist
    num_requests: int = 200
    burstiness: float = 1.0
    seed: int = 0

    def arrivals(self) -> list[Arrival]:
        rng = random.Random(self.seed)
        gaps = arrival_gaps(self.rate, self.burstiness, rng)
        out, t = [], 0.0
        for i in range(self.num_requests):
            if i:
                t += next(gaps)
            out.append(Arrival(t, self.input_len.sample(rng), self.output_len.sample(rng)))
        return out

    def with_rate(self, rate: float) -> Workload:
        return Workload(rate, self.input_len, self.output_len, self.num_requests,
                        self.burstiness, self.seed)


def load_trace(path: str | Path, run: int | None = None) -> list[list[Arrival]]:
    """Arrivals from a load-generator ``results.json`` (one list per run, from each request's
    send time and token counts) or a JSONL file of ``{"at", "input", "output"}`` lines."""
    text = Path(path).read_text()
    if str(path).endswith(".jsonl"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [[Arrival(float(r["at"]), int(r["input"]), int(r["output"]),
                         str(r.get("class", "sim"))) for r in rows]]
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
    """The engine's bounds (``EngineConfig`` / ``AppArgs``)."""

    max_batch_size: int = 16
    token_budget: int = 4096
    prefill_max_rows: int = 8
    batch_wait_s: float = 0.005
    padded_kv: bool = True  # this app's contiguous buffer; False: a paged engine


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


@dataclass(slots=True)
class _Req:
    arrival: Arrival
    sent_at: float
    first_token_at: float | None = None
    finished_at: float | None = None
    generated: int = 0  # output tokens produced so far (the first comes from prefill)

    @property
    def kv_len(self) -> int:
        # KV held: the prompt plus every output token fed back so far
        return self.arrival.input_len + max(self.generated - 1, 0)

    @property
    def max_total(self) -> int:
        return self.arrival.input_len + self.arrival.output_len

    def first_token(self, now: float) -> bool:
        """Prefill's token reaches the decoder at ``now``; True when it was the only one."""
        self.first_token_at = now
        self.generated = 1
        if self.arrival.output_len <= 1:
            self.finished_at = now
            return True
        return False


def _padded_kv_tokens(rows: int, capacity: int) -> int:
    """KV tokens the app's contiguous batch buffer reserves (``ModelRunner.kv_tokens_for``):
    rows 1, 2, 4 then multiples of 4, positions in multiples of 128."""
    rows = 1 << max(0, (rows - 1).bit_length()) if rows <= 4 else -(-rows // 4) * 4
    return rows * max(1, -(-capacity // 128)) * 128


@dataclass(slots=True)
class _Busy:
    prefill_s: float = 0.0
    decode_s: float = 0.0


def _plan_batches(reqs: list[_Req], budget: int, max_rows: int) -> list[list[_Req]]:
    """``app.prefill.plan_batches``: sorted by length, rows x longest within the budget."""
    batches: list[list[_Req]] = []
    batch: list[_Req] = []
    longest = 0
    for r in sorted(reqs, key=lambda r: r.arrival.input_len):
        n = r.arrival.input_len
        if batch and ((len(batch) + 1) * max(longest, n) > budget or len(batch) >= max_rows):
            batches.append(batch)
            batch, longest = [], 0
        batch.append(r)
        longest = max(longest, n)
    if batch:
        batches.append(batch)
    return batches


def _take_batch(queue: deque[_Req], budget: int) -> list[_Req]:
    """``@serve.batch`` with a token ``batch_size_fn``: the queue head up to the budget."""
    taken: list[_Req] = []
    tokens = 0
    while queue:
        w = min(queue[0].arrival.input_len, budget)
        if taken and tokens + w > budget:
            break
        taken.append(queue.popleft())
        tokens += w
    return taken


def _prefill_pass_s(device: DeviceProfile, rows: list[_Req]) -> float:
    """One right-padded prefill pass of ``rows``."""
    return device.prefill_s(len(rows), max(r.arrival.input_len for r in rows))


class _Decoder:
    """One decode batch (``app.decode.Decoder``) on a device."""

    def __init__(self, device: DeviceProfile, limits: EngineLimits, clock: _Clock,
                 finish: Callable[[_Req], None]) -> None:
        self.device = device
        self.limits = limits
        self.clock = clock
        self.finish = finish
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def _fits(self, rows: int, capacity: int, used: int) -> bool:
        if self.limits.padded_kv:
            return _padded_kv_tokens(rows, capacity) <= self.device.kv_budget_tokens
        return used <= self.device.kv_budget_tokens

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.limits.max_batch_size:
            seq = self.waiting[0]
            rows = len(self.running) + 1
            capacity = max([s.max_total for s in self.running] + [seq.max_total])
            used = sum(s.max_total for s in self.running) + seq.max_total
            if not self._fits(rows, capacity, used) and self.running:
                break
            self.running.append(self.waiting.popleft())

    def attended(self) -> int:
        """Context positions the step attends: rows x longest in this app's padded buffer,
        the sum of the contexts in a paged engine."""
        if self.limits.padded_kv:
            return len(self.running) * (max(s.kv_len for s in self.running) + 1)
        return sum(s.kv_len + 1 for s in self.running)

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
            if s.generated >= s.arrival.output_len:
                s.finished_at = now
                self.finish(s)
            else:
                still.append(s)
        self.running = still


class _SplitRun:
    """The split app's replicas on a clock: prefill batches, the KV hop, decode batches."""

    def __init__(self, sysm: SplitSystem, clock: _Clock, finish: Callable[[_Req], None]) -> None:
        self.sysm, self.limits, self.clock, self.finish = sysm, sysm.limits, clock, finish
        self.prefill_busy = [_Busy() for _ in range(sysm.num_prefill)]
        self.decode_busy = [_Busy() for _ in range(sysm.num_decode)]
        self.prefill_queues: list[deque[_Req]] = [deque() for _ in range(sysm.num_prefill)]
        self.prefilling = [False] * sysm.num_prefill
        self.decoders = [_Decoder(sysm.decode, sysm.limits, clock, finish)
                         for _ in range(sysm.num_decode)]
        self.decoding = [False] * sysm.num_decode

    def schedule_arrivals(self, arrivals: Iterable[Arrival]) -> None:
        overhead = self.sysm.prefill.request_overhead_s
        for a in arrivals:
            r = _Req(a, a.at)
            self.clock.at(a.at + overhead, lambda r=r: self.request_arrive(r))

    def busy_devices(self) -> list[tuple[DeviceProfile, _Busy]]:
        return ([(self.sysm.prefill, b) for b in self.prefill_busy]
                + [(self.sysm.decode, b) for b in self.decode_busy])

    def _least_loaded_prefill(self) -> int:
        pq, busy = self.prefill_queues, self.prefilling
        return min(range(len(pq)), key=lambda k: (sum(x.arrival.input_len for x in pq[k])
                                                  + (1 << 30) * busy[k]))

    def request_arrive(self, r: _Req) -> None:
        i = self._least_loaded_prefill()
        self.prefill_queues[i].append(r)
        if not self.prefilling[i]:
            self.prefilling[i] = True
            self.clock.at(self.clock.now + self.limits.batch_wait_s,
                          lambda: self.prefill_start(i))

    def prefill_start(self, i: int) -> None:
        lim = self.limits
        batch = _take_batch(self.prefill_queues[i], lim.token_budget)
        if not batch:
            self.prefilling[i] = False
            return
        cost = sum(_prefill_pass_s(self.sysm.prefill, b)
                   for b in _plan_batches(batch, lim.token_budget, lim.prefill_max_rows))
        self.prefill_busy[i].prefill_s += cost
        self.clock.at(self.clock.now + cost, lambda: self.prefill_end(i, batch))

    def prefill_end(self, i: int, batch: list[_Req]) -> None:
        """Every package of the batch leaves together; each hops to decode on its own."""
        dev = self.sysm.prefill
        for r in batch:
            hop = dev.hop_s(r.arrival.input_len * dev.kv_bytes_per_token)
            self.clock.at(self.clock.now + hop, lambda r=r: self.decode_arrive(r))
        self.prefill_start(i)

    def decode_arrive(self, r: _Req) -> None:
        if r.first_token(self.clock.now):
            self.finish(r)
            return
        j = min(range(len(self.decoders)), key=lambda k: self.decoders[k].load)
        self.decoders[j].waiting.append(r)
        if not self.decoding[j]:
            self.decoding[j] = True
            # after the other events of this instant: sequences that arrive together
            # join the same first step
            self.clock.at(self.clock.now, lambda: self.decode_step(j))

    def decode_step(self, j: int) -> None:
        if not self.decoders[j].start_step(self.decode_busy[j], lambda: self.decode_step(j)):
            self.decoding[j] = False


class _ColocatedRun:
    """The colocated replicas on a clock: one device per replica runs prefill passes between
    decode steps (``interleave``) or mixes prompt chunks into every step (``chunked``)."""

    def __init__(self, sysm: ColocatedSystem, clock: _Clock,
                 finish: Callable[[_Req], None]) -> None:
        self.sysm, self.limits, self.device = sysm, sysm.limits, sysm.device
        self.clock, self.finish = clock, finish
        n = sysm.num_replicas
        self.busy = [_Busy() for _ in range(n)]
        self.prefill_queues: list[deque[_Req]] = [deque() for _ in range(n)]
        self.decoders = [_Decoder(sysm.device, sysm.limits, clock, finish) for _ in range(n)]
        self.active = [False] * n
        self.prefilled: dict[int, int] = {}  # chunked: prompt tokens done, by id(request)

    def schedule_arrivals(self, arrivals: Iterable[Arrival]) -> None:
        overhead = self.device.request_overhead_s
        for a in arrivals:
            r = _Req(a, a.at)
            self.clock.at(a.at + overhead, lambda r=r: self.request_arrive(r))

    def busy_devices(self) -> list[tuple[DeviceProfile, _Busy]]:
        return [(self.device, b) for b in self.busy]

    def request_arrive(self, r: _Req) -> None:
        n = len(self.decoders)
        i = min(range(n), key=lambda k: self.decoders[k].load + len(self.prefill_queues[k]))
        self.prefill_queues[i].append(r)
        if not self.active[i]:
            self.active[i] = True
            self.clock.at(self.clock.now + self.limits.batch_wait_s, lambda: self.next_pass(i))

    def next_pass(self, i: int) -> None:
        """What replica ``i`` runs next: waiting prompts first, else a decode step."""
        if self.sysm.policy == "interleave" and self.prefill_queues[i]:
            self._start_prefill_batch(i)
            return
        if self.sysm.policy == "chunked" and self.prefill_queues[i]:
            self._mixed_pass(i)
            return
        if not self.decoders[i].start_step(self.busy[i], lambda: self.next_pass(i)):
            self.active[i] = False

    def _to_decode(self, i: int, r: _Req) -> None:
        if r.first_token(self.clock.now):
            self.finish(r)
        else:
            self.decoders[i].waiting.append(r)

    # -- interleave ---------------------------------------------------------------------------

    def _start_prefill_batch(self, i: int) -> None:
        lim = self.limits
        batch = _take_batch(self.prefill_queues[i], lim.token_budget)
        self._prefill_pass(i, batch, _plan_batches(batch, lim.token_budget,
                                                   lim.prefill_max_rows))

    def _prefill_pass(self, i: int, batch: list[_Req], passes: list[list[_Req]]) -> None:
        # the batch's passes hold the model one after another; a decode step may slip in
        # between two of them (the runner's lock is taken per pass)
        cost = _prefill_pass_s(self.device, passes[0])
        self.busy[i].prefill_s += cost
        self.clock.at(self.clock.now + cost,
                      lambda: self._after_prefill_pass(i, batch, passes[1:]))

    def _after_prefill_pass(self, i: int, batch: list[_Req], rest: list[list[_Req]]) -> None:
        if not rest:
            for r in batch:
                self._to_decode(i, r)
            self.next_pass(i)
            return
        if not self.decoders[i].start_step(self.busy[i],
                                           lambda: self._prefill_pass(i, batch, rest)):
            self._prefill_pass(i, batch, rest)

    # -- chunked ------------------------------------------------------------------------------

    def _mixed_pass(self, i: int) -> None:
        # one mixed pass: every running sequence decodes, the oldest prompt advances by up
        # to chunk_tokens (prompts progress one after another)
        dec = self.decoders[i]
        dec.admit()
        r = self.prefill_queues[i][0]
        done_tokens = self.prefilled.get(id(r), 0)
        chunk = min(self.sysm.chunk_tokens, r.arrival.input_len - done_tokens)
        ctx = done_tokens + chunk
        cost = self._mixed_pass_s(dec, chunk, ctx)
        self.busy[i].prefill_s += cost
        self.clock.at(self.clock.now + cost, lambda: self._after_mixed_pass(i, r, ctx))

    def _mixed_pass_s(self, dec: _Decoder, chunk: int, ctx: int) -> float:
        """A prompt chunk of ``chunk`` tokens (context ``ctx``) plus a step of ``dec``'s
        running sequences in one pass: compute and memory terms add up."""
        dev = self.device
        p_compute = dev.prefill.compute(chunk, chunk * ctx)
        p_memory = dev.prefill.memory(chunk, 0.0) - dev.prefill.memory.c0
        if dec.running:
            b, ctx_tokens = len(dec.running), dec.attended()
            d_compute = dev.decode.compute(b, ctx_tokens)
            d_memory = dev.decode.memory(b, ctx_tokens)
        else:
            d_compute, d_memory = 0.0, dev.prefill.memory.c0
        return dev.decode.overhead_s + max(p_compute + d_compute, p_memory + d_memory)

    def _after_mixed_pass(self, i: int, r: _Req, ctx: int) -> None:
        dec = self.decoders[i]
        if dec.running:
            dec.end_step()
        if ctx >= r.arrival.input_len:
            self.prefill_queues[i].popleft()
            self.prefilled.pop(id(r), None)
            self._to_decode(i, r)
        else:
            self.prefilled[id(r)] = ctx
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

    def _finish(self, r: _Req) -> None:
        self.done.append(r)


# ---- results ----------------------------------------------------------------------------


@dataclass(slots=True)
class SimResult:
    system: str
    records: list[RequestRecord]
    duration_s: float
    price_per_hour: float
    energy_j: float

    @classmethod
    def build(cls, system: System, done: Iterable[_Req],
              busy: list[tuple[DeviceProfile, _Busy]]) -> SimResult:
        records = []
        for r in sorted(done, key=lambda r: r.sent_at):
            assert r.first_token_at is not None and r.finished_at is not None
            records.append(RequestRecord(
                r.arrival.request_class, r.sent_at, prompt_tokens=r.arrival.input_len,
                output_tokens=r.arrival.output_len, ttft_s=r.first_token_at - r.sent_at,
                e2e_s=r.finished_at - r.sent_at, ok=True))
        end = max((r.finished_at for r in done if r.finished_at is not None), default=0.0)
        duration = max(end, 1e-9)
        energy = 0.0
        for dev, b in busy:
            idle = max(duration - b.prefill_s - b.decode_s, 0.0)
            energy += (b.prefill_s * dev.power_prefill_w + b.decode_s * dev.power_decode_w
                       + idle * dev.power_idle_w)
        return cls(system.describe(), records, duration, system.price_per_hour, energy)

    def summary(self, slos: dict[str, float] | None = None) -> dict[str, Any]:
        s = summarize(self.records, self.duration_s, slos)
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
