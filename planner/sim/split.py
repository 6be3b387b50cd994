"""The split system: prefill replicas, the KV hop, decode replicas, local prefill of short
prompts."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from planner.hardware import DeviceProfile
from planner.sim.constants import LANE_WEIGHT
from planner.sim.engine import _answers, _Busy, _Clock, _PrefillQueue, _Req, _Seq, weighted_share
from planner.sim.replicas import _Engines
from planner.sim.systems import SplitSystem
from planner.sim.workload import Arrival


@dataclass(eq=False, slots=True)
class _Pass:
    """A prefill pass under way on shared cores: its prompts, its work left (seconds on a
    core of its own), since when at what rate (its share of a core, or ``wide`` on idle
    cores), and which of its end events stands (``gen``)."""

    rows: list[_Req]
    work: float
    since: float
    wide: float = 1.0  # its rate alone on the machine (``SplitSystem.prefill_wide``)
    rate: float = 1.0
    gen: int = 0


class _SplitRun:
    """The split app's replicas on a clock: prefill passes, the KV hop, decode batches, and
    the ingress's choice of where a prompt is prefilled (``SplitPath._prefills_locally``)."""

    def __init__(self, sysm: SplitSystem, clock: _Clock, finish: Callable[[_Seq], None]) -> None:
        self.sysm, self.limits, self.clock, self.finish = sysm, sysm.limits, clock, finish
        self.prefill_busy = [_Busy() for _ in range(sysm.num_prefill)]
        # per replica: which of its lanes has a pass under way, and the prompts in them
        self.lane_busy = [[False] * sysm.limits.prefill_lanes for _ in range(sysm.num_prefill)]
        self.in_pass: list[set[_Req]] = [set() for _ in range(sysm.num_prefill)]
        self.prefills = [_PrefillQueue(sysm.prefill, sysm.limits)
                         for _ in range(sysm.num_prefill)]
        # DecodeServer: a decode loop and a prefill queue for the prompts prefilled locally
        self.decode = _Engines(sysm.decode, sysm.num_decode, sysm.limits, sysm.decode_policy,
                               clock, finish)
        self.decode.on_prefilled = self._stream_starts
        self.decode.share = self.decode_share
        self.decode.on_sleep = self._decode_changed
        self.homes = random.Random(0)  # each prompt's rendezvous-hash home replica
        self.busy_tokens = sysm.limits.busy_prefill_tokens
        # on shared_cores: the passes under way, by (replica, lane), and the decode side as
        # their shares last saw it (``_reshare``)
        self.running: dict[tuple[int, int], _Pass] = {}
        self.shared_key: tuple[bool, ...] = ()
        # SplitPath's counts: prompt tokens whose streams have not started, sent to the
        # prefill phase, of those the short ones, and sent to a decode replica
        self.prefill_backlog = self.short_backlog = self.local_backlog = 0

    def schedule_arrivals(self, arrivals: Iterable[Arrival]) -> None:
        overhead = self.sysm.prefill.request_overhead_s
        for uid, a in enumerate(arrivals):
            r = _Req(a, a.at, uid)
            self.clock.at(a.at + overhead, lambda r=r: self.request_arrive(r))

    def busy_devices(self) -> list[tuple[DeviceProfile, _Busy]]:
        return ([(self.sysm.prefill, b) for b in self.prefill_busy]
                + [(self.sysm.decode, b) for b in self.decode.busy])

    def _route_prefill(self) -> int:
        qs = self.prefills
        least = min(range(len(qs)), key=lambda k: (len(qs[k]), qs[k].tokens))
        if self.limits.prefill_routing == "least_loaded" or len(qs) == 1:
            return least
        home = self.homes.randrange(len(qs))
        if len(qs[home]) - len(qs[least]) > self.limits.affinity_imbalance:
            return least
        return home

    def _is_short(self, r: _Req) -> bool:
        return r.arrival.input_len < self.limits.local_prefill_when_busy

    def prefills_locally(self, r: _Req) -> bool:
        """``SplitPath._prefills_locally``: under ``local_prefill_threshold``; or short while
        the prefill phase is backed up and the decode side has fewer tokens ahead of it
        (its local prompts not yet streaming) than the prefill phase (its short prompts and
        at most two passes of longer ones)."""
        if r.arrival.input_len < self.limits.local_prefill_threshold:
            return True
        if not self._is_short(r) or self.prefill_backlog < self.busy_tokens:
            return False
        longer = self.prefill_backlog - self.short_backlog
        ahead_there = self.short_backlog + min(longer, 2 * self.busy_tokens)
        return self.local_backlog < ahead_there

    def _count(self, r: _Req, sign: int) -> None:
        """``Backlog._count``."""
        n = sign * r.backlog
        if r.local:
            self.local_backlog += n
        else:
            self.prefill_backlog += n
            if r.short:
                self.short_backlog += n

    def _stream_starts(self, r: _Req) -> None:
        """``r``'s stream starts (``StreamStart``: local, its package made; otherwise on the
        decode replica, the hop done): its tokens leave the backlog counts."""
        if r.backlog:
            self._count(r, -1)
            r.backlog = 0

    def request_arrive(self, r: _Req) -> None:
        r.local = self.prefills_locally(r)
        if r.arrival.n == 1:
            # n > 1 is prefilled once for its answers (``SplitPath.shared_prefill``), whose
            # streams read that package: neither is counted in a backlog
            r.backlog, r.short = r.arrival.input_len, not r.local and self._is_short(r)
            self._count(r, +1)
        if r.local:  # DecodeServer.generate_local: on the least loaded decode replica
            self.decode.add_prompt(self.decode.least_loaded(), r)
            return
        i = self._route_prefill()
        q = self.prefills[i]
        q.add(r, self.clock.now)
        if q.idle:
            q.idle = False
            self.clock.at(self.clock.now + self.limits.batch_wait_s,
                          lambda: self.prefill_start(i))
        elif 0 < self.passes(i) < self.limits.prefill_lanes:
            # the queue's loop is awake (a pass runs): a free lane takes it at once
            # (``PrefillQueue._run_lanes``)
            self.prefill_start(i)

    def passes(self, i: int) -> int:
        """Prefill passes under way on replica ``i`` (one per busy lane)."""
        return sum(self.lane_busy[i])

    def prefill_start(self, i: int) -> None:
        """Passes on replica ``i``'s free lanes, while prompts in no pass wait."""
        q = self.prefills[i]
        started = False
        while self.passes(i) < self.limits.prefill_lanes:
            lane = self.lane_busy[i].index(False)
            busy: Collection[_Req] = self.in_pass[i]
            if lane > 0:  # an extra lane takes long prompts only (PrefillPolicy)
                busy = busy | {e[3] for e in q._order if not q.policy.extra_lane_takes(e[3])}
            rows = q.plan(self.clock.now, busy)
            if not rows:
                break
            work = q.pass_s(rows)  # on a core of its own
            self.lane_busy[i][lane] = True
            self.in_pass[i].update(rows)
            if self.sysm.shared_cores is None:
                # its share of its device (split with the replica's other passes), fixed
                cost = work * self.passes(i)
                self.prefill_busy[i].prefill_s += cost
                self.clock.at(self.clock.now + cost,
                              lambda rows=rows, lane=lane: self.prefill_end(i, rows, lane))
            else:
                wide = self.sysm.prefill_wide
                speed = (work / q.pass_s(rows, wide) if wide is not None and lane == 0
                         and self.limits.prefill_max_threads > 1 else 1.0)
                self.running[(i, lane)] = _Pass(rows, work, self.clock.now, speed)
                started = True
        if started:
            self._reshare()
        if not self.passes(i):
            q.idle = True

    def _reshare(self) -> None:
        """On ``shared_cores``: each pass under way runs on its share of them beside what
        else runs now (``_shares``), or, alone on the machine (no other pass, no decode
        replica stepping), on its idle cores too (``_Pass.wide``); called whenever that
        changes (a pass starts or ends, a decode replica starts or stops stepping), each
        pass's end moving with its rate."""
        now = self.clock.now
        self.shared_key = self._decode_key()
        alone = len(self.running) == 1 and not any(self.decode.active)
        for (i, lane), p in self.running.items():
            p.work -= p.rate * (now - p.since)
            self.prefill_busy[i].prefill_s += now - p.since
            p.since, p.gen = now, p.gen + 1
            p.rate = (p.wide if alone else
                      self._shares(LANE_WEIGHT if lane > 0 else 1.0, exclude_pass=(i, lane)))
            self.clock.at(now + max(p.work, 0.0) / p.rate,
                          lambda i=i, lane=lane, p=p, gen=p.gen: self._pass_done(i, lane, p, gen))

    def _pass_done(self, i: int, lane: int, p: _Pass, gen: int) -> None:
        if gen != p.gen:
            return  # its share changed since: a later event ends it
        self.prefill_busy[i].prefill_s += self.clock.now - p.since
        del self.running[(i, lane)]
        self.prefill_end(i, p.rows, lane)
        self._reshare()

    def _decode_key(self) -> tuple[bool, ...]:
        """What of the decode side a pass's share depends on: which replicas step, and
        whether any tokens stream."""
        dec = self.decode
        return (*dec.active, any(d.running for d in dec.decoders))

    def _decode_changed(self) -> None:
        if self.running and self._decode_key() != self.shared_key:
            self._reshare()

    def decode_share(self, j: int) -> float:
        """The part of a core decode replica ``j``'s engine gets for a step starting now
        (fixed for the step); the passes under way are reshared when the decode side
        changed since they last were."""
        if self.sysm.shared_cores is None:
            return 1.0
        self._decode_changed()
        return self._shares(1.0, exclude_decode=j)

    def _shares(self, weight: float, exclude_decode: int | None = None,
                exclude_pass: tuple[int, int] | None = None) -> float:
        """The share of ``shared_cores`` a thread of ``weight`` starting now gets beside what
        already runs: each busy decode replica's engine (weight 1), each pass under way (1
        on a replica's first lane; ``LANE_WEIGHT`` on an extra lane, which runs at the
        lowest priority) and the serving stack while tokens stream (``stack_cores`` of CPU at
        most, weight 1). Linux shares the cores in proportion to the weights
        (``weighted_share``)."""
        weights, caps = [weight], [1.0]
        for i, lanes in enumerate(self.lane_busy):
            for k, busy in enumerate(lanes):
                if busy and (i, k) != exclude_pass:
                    weights.append(1.0 if k == 0 else LANE_WEIGHT)
                    caps.append(1.0)
        for j in range(len(self.decode.decoders)):
            if self.decode.active[j] and j != exclude_decode:
                weights.append(1.0)
                caps.append(1.0)
        if self.sysm.stack_cores > 0 and any(d.running for d in self.decode.decoders):
            weights.append(1.0)
            caps.append(self.sysm.stack_cores)
        return weighted_share(self.sysm.shared_cores, weights, caps)

    def prefill_end(self, i: int, rows: list[_Req], lane: int = 0) -> None:
        """Each prompt this pass finished leaves; each answer hops to decode on its own."""
        dev = self.sysm.prefill
        self.lane_busy[i][lane] = False
        self.in_pass[i].difference_update(rows)
        for r in self.prefills[i].advance(rows):
            hop = dev.hop_s(r.arrival.input_len * dev.kv_bytes_per_token)
            for s in _answers(r):
                self.clock.at(self.clock.now + hop, lambda s=s: self.decode_arrive(s))
        self.prefill_start(i)

    def decode_arrive(self, s: _Seq) -> None:
        self._stream_starts(s.req)
        if s.first_token(self.clock.now):
            self.finish(s)
            return
        self.decode.add_seq(self.decode.least_loaded(), s, defer=True)
