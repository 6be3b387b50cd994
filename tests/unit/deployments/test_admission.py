"""Load shedding: a request whose estimated wait for a first token is over the limit is
refused at once with Retry-After; an idle app, a short queue, or one without a measured rate
admits."""

from __future__ import annotations

import pytest

from app.errors import QueueFullError
from deployments.admission import QueueWait


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_refuses_when_the_waiting_answers_would_take_longer_than_the_limit():
    clock = Clock()
    q = QueueWait(limit_s=10.0, window_s=30.0, min_waiting=4, clock=clock)
    for _ in range(15):  # 15 first tokens in the last 30 s: 0.5 per second
        q.entered()
        q.first_token()
        clock.now += 2.0
    for _ in range(4):
        q.admit()
        q.entered()
    assert q.estimate_s() == pytest.approx(5 / (15 / 30))  # 10 s: at the limit, admitted
    q.admit()
    q.entered()
    with pytest.raises(QueueFullError) as refused:
        q.admit()  # 6 waiting at 0.5/s: 12 s
    assert refused.value.status_code == 429 and refused.value.retry_after_s == 2.0
    assert q.refused == 1
    q.first_token()  # the queue moves: a new arrival fits again
    q.admit()


def test_admits_without_a_rate_or_with_a_short_queue():
    clock = Clock()
    q = QueueWait(limit_s=1.0, min_waiting=4, clock=clock)
    for _ in range(50):  # nothing has started yet (or for a whole window): no estimate
        q.admit()
        q.entered()
    assert q.estimate_s() is None
    q2 = QueueWait(limit_s=1.0, min_waiting=4, clock=clock)
    q2.entered(), q2.first_token()
    clock.now += 1
    q2.entered(), q2.first_token()
    for _ in range(3):  # a slow rate, but under min_waiting answers wait
        q2.admit()
        q2.entered()


def test_first_tokens_older_than_the_window_are_forgotten_and_leavers_are_not_waiting():
    clock = Clock()
    q = QueueWait(limit_s=5.0, window_s=10.0, min_waiting=1, clock=clock)
    for _ in range(5):
        q.entered()
        q.first_token()
    clock.now += 11.0
    assert q.estimate_s() is None
    q.entered()
    q.left_without_token()  # a client that left (or failed) before its first token
    assert q.waiting == 0
