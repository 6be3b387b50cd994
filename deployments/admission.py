"""Load shedding at the ingress: refuse at once what would wait too long for its first token.

Under sustained overload every queue in front of the engines fills (the KV budget's waiters,
the prefill queue, decode's waiting sequences) and an admitted request's time to first token
grows with it, until the request timeout ends it. ``QueueWait`` keeps that wait bounded: it
counts the answers in this ingress that have no first token yet and how fast answers are
getting their first token (over the last ``window_s``), and estimates a new arrival's wait as
``(waiting + 1) / rate``. When that estimate is over ``limit_s``, the request gets 429 with
``Retry-After`` at once, before any replica works on it. With fewer than ``min_waiting``
answers waiting, or no first tokens seen in the window (an idle or just-started app), it
admits: the estimate needs a rate to stand on.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable

from app.errors import QueueFullError


class QueueWait:
    def __init__(self, limit_s: float, window_s: float = 30.0, min_waiting: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_s = limit_s
        self.window_s = window_s
        self.min_waiting = min_waiting
        self.clock = clock
        self.waiting = 0  # answers admitted and still without a first token
        self.refused = 0
        self._firsts: collections.deque[float] = collections.deque()

    def _rate(self, now: float) -> float | None:
        """First tokens per second over the window; None under two of them."""
        while self._firsts and now - self._firsts[0] > self.window_s:
            self._firsts.popleft()
        if len(self._firsts) < 2:
            return None
        return len(self._firsts) / self.window_s

    def estimate_s(self) -> float | None:
        """How long a request arriving now would wait for its first token (None: unknown)."""
        rate = self._rate(self.clock())
        return None if rate is None else (self.waiting + 1) / rate

    def admit(self) -> None:
        """Raise QueueFullError (429) when the estimated wait is over the limit."""
        if self.waiting < self.min_waiting:
            return
        estimate = self.estimate_s()
        if estimate is None or estimate <= self.limit_s:
            return
        self.refused += 1
        raise QueueFullError(
            f"the server is overloaded: a new request would wait about {estimate:.0f} s for "
            f"its first token (limit {self.limit_s:g} s); retry later",
            retry_after_s=float(min(60, max(1, math.ceil(estimate - self.limit_s)))))

    def entered(self) -> None:
        self.waiting += 1

    def first_token(self) -> None:
        self.waiting = max(0, self.waiting - 1)
        self._firsts.append(self.clock())

    def left_without_token(self) -> None:
        self.waiting = max(0, self.waiting - 1)
