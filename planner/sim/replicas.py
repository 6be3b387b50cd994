"""Replicas of one system on the event clock: routing, prefill and decode engines, busy time."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from planner.hardware import DeviceProfile
from planner.sim.engine import _answers, _Busy, _Chunks, _Clock, _Decoder, _PrefillQueue, _Req, _Seq
from planner.sim.systems import EngineLimits


class _Engines:
    """Replicas whose one engine both decodes and prefills prompts, one pass at a time in
    the order they were submitted: the colocated app's ``ColocatedServer``, and the split
    app's ``DecodeServer`` for the prompts it prefills itself. ``policy`` says how a
    replica's prompts share the engine with its decode steps (``COLOCATED_POLICIES``; the
    module docstring)."""

    def __init__(self, device: DeviceProfile, n: int, limits: EngineLimits, policy: str,
                 clock: _Clock, finish: Callable[[_Seq], None], chunk_tokens: int = 512) -> None:
        self.device, self.limits, self.policy = device, limits, policy
        self.chunk_tokens, self.clock, self.finish = chunk_tokens, clock, finish
        self.busy = [_Busy() for _ in range(n)]
        self.prefills = [_PrefillQueue(device, limits) for _ in range(n)]
        self.mixed_queues: list[deque[_Req]] = [deque() for _ in range(n)]  # chunked
        self.decoders = [_Decoder(device, limits, clock, finish) for _ in range(n)]
        self.active = [False] * n
        self.ready_at = [0.0] * n  # the prefill queue's wake-up wait ends
        self.last_was_prefill = [False] * n  # interleave
        # mixed: the rows of the queue's own pass under way, and the chunks of the step the
        # decode loop planned while it ran (None: none planned)
        self.own_pass: list[list[_Req] | None] = [None] * n
        self.planned: list[_Chunks | None] = [None] * n
        self.planned_joins = [0] * n  # the sequences the loop held then (it admits those)
        self.on_prefilled: Callable[[_Req], None] = lambda r: None  # a prompt's package is made
        # the part of its device replica ``i``'s engine gets for a pass starting now (the
        # split's decode replicas on cores shared with prefill: ``_SplitRun.decode_share``)
        self.share: Callable[[int], float] = lambda i: 1.0
        self.on_sleep: Callable[[], None] = lambda: None  # an engine went idle

    def load(self, k: int) -> int:
        """Replica ``k``'s streams and prompts (what Serve's router counts on it)."""
        return self.decoders[k].load + len(self.prefills[k]) + len(self.mixed_queues[k])

    def least_loaded(self) -> int:
        return min(range(len(self.decoders)), key=self.load)

    def add_prompt(self, i: int, r: _Req) -> None:
        """``r`` joins replica ``i``'s prefill queue."""
        now = self.clock.now
        if self.policy == "chunked":
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

    def add_seq(self, j: int, s: _Seq, *, defer: bool = False) -> None:
        """An answer whose first token is out joins replica ``j``'s decode loop; ``defer``:
        after the other events of this instant (answers that arrive together join the same
        first step)."""
        self.decoders[j].waiting.append(s)
        if self.active[j]:
            if self.policy == "mixed" and self.own_pass[j] is not None \
                    and self.planned[j] is None:
                # the loop wakes during the queue's pass and plans its first step's chunks
                # now (``DecodeLoop._take_chunks``); the step waits for the pass to end
                self.planned[j] = self._plan_step(j)
            return
        self.active[j] = True
        if defer:
            self.clock.at(self.clock.now, lambda: self.next_pass(j))
        else:
            self.next_pass(j)

    def _sleep(self, i: int) -> None:
        """Replica ``i``'s engine has nothing to run."""
        self.active[i] = False
        self.on_sleep()

    def _wake(self, i: int) -> None:
        if not self.active[i]:
            self.active[i] = True
            self.next_pass(i)

    def next_pass(self, i: int) -> None:
        """What replica ``i`` runs next."""
        if self.policy == "mixed":
            self._next_mixed(i)
            return
        if self.policy == "chunked":
            if self.mixed_queues[i]:
                self._chunked_pass(i)
            elif not self.decoders[i].start_step(self.busy[i], lambda: self.next_pass(i),
                                                 self.share(i)):
                self._sleep(i)
            return
        # interleave: the engine thread runs what was submitted first; while both loops
        # have work, a prefill pass and a decode step take turns
        q = self.prefills[i]
        prefill_ready = len(q) > 0 and self.clock.now >= self.ready_at[i]
        if prefill_ready and not self.last_was_prefill[i]:
            self._prefill_pass(i)
        elif self.decoders[i].start_step(self.busy[i], lambda: self.next_pass(i),
                                             self.share(i)):
            self.last_was_prefill[i] = False
        elif prefill_ready:
            self._prefill_pass(i)
        else:
            self._sleep(i)  # a prompt still in its wake-up wait restarts it

    def _prefilled(self, i: int, r: _Req) -> None:
        """A prompt's prefill ended on replica ``i``: its answer decodes there (``n = 1``) or
        each answer on the least loaded replica, through the object store."""
        self.on_prefilled(r)
        for s in _answers(r):
            j = i
            if r.arrival.n > 1:
                j = min(range(len(self.decoders)), key=lambda k: (self.load(k), k != i))
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
        if s.first_token(self.clock.now):
            self.finish(s)
        else:
            self.add_seq(j, s)

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
            self._prefilled(i, r)
        if not len(q):
            q.idle = True
        self.next_pass(i)

    # -- mixed (this app) ---------------------------------------------------------------------

    def _next_mixed(self, i: int) -> None:
        """While the decode loop has sequences, each of its steps carries the queue's next
        chunks; with none, the queue runs passes of its own (``PrefillQueue._run``)."""
        dec, q = self.decoders[i], self.prefills[i]
        if self.planned[i] is not None or dec.waiting or dec.running:
            self._mixed_step(i)
        elif len(q) and self.clock.now >= self.ready_at[i]:
            self._own_pass(i)
        else:
            self._sleep(i)  # a prompt still in its wake-up wait restarts it
            if not len(q):
                q.idle = True  # the queue's task sleeps until a prompt comes

    def _plan_step(self, i: int) -> _Chunks:
        """The chunks of replica ``i``'s next decode step (``DecodeLoop._take_chunks``: the
        rows it may run, before admission), none of a pass under way."""
        dec = self.decoders[i]
        self.planned_joins[i] = len(dec.waiting)
        rows = min(self.limits.max_batch_size, len(dec.running) + len(dec.waiting))
        return self.prefills[i].plan_chunks(self.clock.now, rows, self.own_pass[i] or ())

    def _mixed_step(self, i: int) -> None:
        dec = self.decoders[i]
        plan, self.planned[i] = self.planned[i], None
        if plan is None:
            plan = self._plan_step(i)
        # sequences that came after the plan was made wait for the next step (the loop
        # applies what was handed over between steps, then plans)
        dec.admit(self.planned_joins[i])
        if plan.rows:
            cost = self._mixed_pass_s(dec, [(n, r.done) for r, n in zip(plan.rows, plan.sizes,
                                                                       strict=True)],
                                      self.share(i))
            self.busy[i].prefill_s += cost
        else:
            cost = dec.step_cost(self.share(i))
            self.busy[i].decode_s += cost
        self.clock.at(self.clock.now + cost, lambda: self._after_mixed_step(i, plan))

    def _after_mixed_step(self, i: int, plan: _Chunks) -> None:
        dec = self.decoders[i]
        if dec.running:
            dec.end_step()
        if plan.rows:
            for r in self.prefills[i].advance(plan.rows, plan.sizes):
                self._prefilled(i, r)
        self.next_pass(i)

    def _own_pass(self, i: int) -> None:
        q = self.prefills[i]
        rows = q.plan(self.clock.now)
        cost = q.pass_s(rows)
        self.busy[i].prefill_s += cost
        self.own_pass[i] = rows
        self.clock.at(self.clock.now + cost, lambda: self._after_own_pass(i, rows))

    def _after_own_pass(self, i: int, rows: list[_Req]) -> None:
        dec, q = self.decoders[i], self.prefills[i]
        self.own_pass[i] = None
        loop_busy = self.planned[i] is not None or bool(dec.waiting or dec.running)
        for r in q.advance(rows):
            self._prefilled(i, r)
        if not loop_busy and len(q):
            # the queue's task plans its next pass at once, before the streams of the
            # prompts this pass finished reach the decode loop; the loop's first step is
            # planned during that pass and runs after it
            self._own_pass(i)
            if dec.waiting:
                self.planned[i] = self._plan_step(i)
            return
        self.next_pass(i)

    def _mixed_pass_s(self, dec: _Decoder, chunks: Sequence[tuple[int, int]],
                      share: float = 1.0) -> float:
        """One pass of prompt chunks (``(tokens, past)`` each, laid end to end, each
        attending to its own past) plus a step of ``dec``'s running sequences: the linear
        layers run once over every token, so compute and memory terms add up, the weights
        read once; a step that streams tokens pays the serving stack's per-step cost, and
        its chunks cost the engine's own time (``prefill_slowdown``, fitted on lone
        prompts' TTFTs, is the stack's effect on a pass with no stream beside it; a chunk
        riding a step is already charged the stack's per-step cost: charging both
        over-predicted the colocated app's TPOT by 20-100% in validation v10 and v12). The
        engine runs on ``share`` of its device."""
        dev = self.device
        tokens = sum(n for n, _ in chunks)
        pairs = sum(n * (n + 2 * past) for n, past in chunks)
        p_compute = dev.prefill.compute(tokens, pairs)
        p_memory = dev.prefill.memory(tokens, 0.0) - dev.prefill.memory.c0
        if dec.running:
            b, ctx_tokens = len(dec.running), dec.attended()
            d_compute = dev.decode.compute(b, ctx_tokens)
            d_memory = dev.decode.memory(b, ctx_tokens)
            p_compute /= dev.prefill_slowdown
            p_memory /= dev.prefill_slowdown
            stack = dev.decode_stack(b, 0.0)
        else:
            d_compute, d_memory, stack = 0.0, dev.prefill.memory.c0, 0.0
        engine = dev.decode.overhead_s + max(p_compute + d_compute, p_memory + d_memory)
        return engine / share + stack

    # -- chunked (vLLM/Sarathi-style) ---------------------------------------------------------

    def _chunked_pass(self, i: int) -> None:
        # one mixed pass: every running sequence decodes, the oldest prompt advances by up
        # to chunk_tokens (prompts progress one after another)
        dec = self.decoders[i]
        dec.admit()
        r = self.mixed_queues[i][0]
        chunk = min(self.chunk_tokens, r.remaining)
        cost = self._mixed_pass_s(dec, [(chunk, r.done)])
        self.busy[i].prefill_s += cost
        self.clock.at(self.clock.now + cost, lambda: self._after_chunked_pass(i, r, chunk))

    def _after_chunked_pass(self, i: int, r: _Req, chunk: int) -> None:
        dec = self.decoders[i]
        if dec.running:
            dec.end_step()
        r.done += chunk
        if not r.remaining:
            self.mixed_queues[i].popleft()
            self._prefilled(i, r)
        self.next_pass(i)
