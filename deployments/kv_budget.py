"""Backpressure from decode to prefill: the KV bytes one ingress lets into the object store.

A KV package is made by a prefill replica and stored in its node's object store; the decode
replica that streams the request reads it from there. Ray keeps an object that a task takes
as an argument until that task finishes, and the decode stream is that task, so a package
stays in the prefill node's store (pinned, it cannot be evicted) until its stream ends, not
only until decode has copied it. When decode holds many streams, or takes packages more slowly
than prefill makes them (its replicas hold all the calls they accept, their handle queues),
packages pile up until Ray spills them to disk or fails the prefill's return.

``KVBudget`` bounds that pile: a request reserves its package's bytes before its prompt goes
to prefill and gives them back when its stream ends (or the request fails), and a request that
does not fit waits, within its own deadline, before prefill. So prefill slows to the pace at
which decode finishes streams, and the store holds at most the budget of KV.

Order: a request that fits goes at once, so short prompts (small packages) are not held up by
a long document waiting for room; but once a waiter has waited ``fairness_s``, nobody overtakes
it. A package larger than the whole budget goes alone (when nothing else is reserved): it could
never fit otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Waiter:
    nbytes: int
    since: float
    future: asyncio.Future = field(repr=False)


class Reservation:
    """Bytes held for one package, released once per holder (``n > 1``: one package read by
    several answers is released by the last of them). Releasing more often than it has
    holders does nothing, so every path may release it."""

    def __init__(self, budget: KVBudget | None, nbytes: int, holders: int = 1) -> None:
        self.budget = budget
        self.nbytes = nbytes
        self.holders = holders
        self.wait_s = 0.0  # how long the request waited for room

    def release(self) -> None:
        if self.holders <= 0:
            return
        self.holders -= 1
        if self.holders == 0 and self.budget is not None:
            self.budget._give_back(self.nbytes)


class KVBudget:
    """``capacity`` bytes of KV packages in the object store (reserved before prefill, given
    back when the request's stream ends). Not thread-safe: one event loop."""

    def __init__(self, capacity: int, fairness_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.fairness_s = fairness_s
        self.clock = clock
        self.used = 0
        self.peak = 0  # most bytes reserved at once
        self.waited = 0  # reservations that had to wait
        self._waiters: list[_Waiter] = []

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, nbytes: int) -> bool:
        return self.used == 0 or self.used + nbytes <= self.capacity

    def _take(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def _blocked_by_elder(self, now: float) -> bool:
        """A waiter that has waited ``fairness_s`` is first in line: nobody overtakes it."""
        return any(now - w.since >= self.fairness_s for w in self._waiters)

    async def reserve(self, nbytes: int, holders: int = 1) -> Reservation:
        """Room for a package of ``nbytes``; waits until there is some (cancel the call to
        give up: its place is freed)."""
        nbytes = max(0, int(nbytes))
        now = self.clock()
        if self._fits(nbytes) and not self._blocked_by_elder(now):
            self._take(nbytes)
            return Reservation(self, nbytes, holders)
        waiter = _Waiter(nbytes, now, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self.waited += 1
        try:
            await waiter.future
        except BaseException:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                self._grant()  # a blocked head leaving may let others go
            elif waiter.future.done() and not waiter.future.cancelled():
                self._give_back(nbytes)  # granted as it was cancelled: hand it back
            raise
        reservation = Reservation(self, nbytes, holders)
        reservation.wait_s = self.clock() - now
        return reservation

    def _give_back(self, nbytes: int) -> None:
        self.used = max(0, self.used - nbytes)
        self._grant()

    def _grant(self) -> None:
        """Let waiters go in arrival order while they fit; one that has waited past the
        fairness bound and does not fit stops the rest."""
        now = self.clock()
        for waiter in list(self._waiters):
            if waiter.future.done():  # cancelled, not yet removed
                self._waiters.remove(waiter)
                continue
            if self._fits(waiter.nbytes):
                self._waiters.remove(waiter)
                self._take(waiter.nbytes)
                waiter.future.set_result(None)
            elif now - waiter.since >= self.fairness_s:
                break

    def stats(self) -> dict[str, int]:
        return {"kv_in_flight_bytes": self.used, "kv_in_flight_peak_bytes": self.peak,
                "kv_budget_bytes": self.capacity, "kv_budget_waiting": self.waiting,
                "kv_budget_waited": self.waited}


def budget_from_cluster(nodes: list[dict], fraction: float, ingress_replicas: int) -> int:
    """The default budget of one ingress replica: ``fraction`` of the smallest object store
    among the cluster's live nodes (``ray.nodes()``), shared by the ingress replicas."""
    stores = [float(n.get("Resources", {}).get("object_store_memory") or 0)
              for n in nodes if n.get("Alive", True)]
    stores = [s for s in stores if s > 0]
    if not stores:
        raise ValueError("no live node reports an object store size; set "
                         "ingress.kv_in_flight_bytes")
    return max(1, int(min(stores) * fraction / max(1, ingress_replicas)))
