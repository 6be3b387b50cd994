"""Threads for a prefill pass from the cores the rest of the machine leaves idle.

Where the phases share one machine's cores (``serve_configs/local.yaml``: a prefill replica
and a decode replica on one thread each), the decode replica's core sits idle whenever no
stream is running: a long prompt arriving alone, a wave of chats before their streams start.
``EngineConfig.prefill_max_threads`` lets a prefill pass take such cores: before each pass,
the CPU time the machine spent (``/proc/stat``) less this process's own (the process's CPU
clock) since the last pass, over the wall time between them, is what the others used; the
pass gets ``num_threads`` plus the whole cores they left idle, up to ``prefill_max_threads``.
A decode stream that starts meanwhile shares a core with the pass until it ends (a pass is
at most ``prefill_chunk_tokens`` long), and the next pass sees the core busy and keeps to
``num_threads``.

Off by default: on a machine given to one phase the replica's ``num_threads`` is its share,
and in a container ``/proc/stat`` counts the host's cores, not the container's quota.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

# a window shorter than this says little (the kernel counts CPU time in 10 ms ticks): the
# last decision stands
_MIN_WINDOW_S = 0.05
# a core counts as idle when the others left at least this much of it
_IDLE_FRACTION = 0.75
# how often the replica's log says how its passes' threads went
_REPORT_S = 30.0

logger = logging.getLogger(__name__)


def machine_busy_s(stat: Path) -> float | None:
    """CPU seconds the whole machine has spent busy (all but idle and iowait), or None."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class IdleCores:
    """How many threads the next pass may use: ``base`` plus the cores the rest of the
    machine left idle since the previous pass, at most ``most``."""

    def __init__(self, base: int, most: int, stat: Path = Path("/proc/stat")) -> None:
        assert 1 <= base <= most
        self.base, self.most, self.stat = base, most, stat
        self.cores = len(os.sched_getaffinity(0))
        self.threads = base
        self._last = self._sample()
        # since start: decisions on a load sample, those above base, the others' load summed
        self.decisions = self.wider = 0
        self.others_total = 0.0
        # when the log last reported, and the three counts then
        self._reported = self._last[0]
        self._reported_counts = (0, 0, 0.0)

    def _sample(self) -> tuple[float, float | None, float]:
        return time.monotonic(), machine_busy_s(self.stat), time.process_time()

    def others_busy(self, before, after) -> float | None:
        """Cores the rest of the machine kept busy between two samples, or None."""
        (t0, busy0, own0), (t1, busy1, own1) = before, after
        if busy0 is None or busy1 is None or t1 - t0 <= 0:
            return None
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)

    def next_pass(self) -> int:
        """Threads for the pass about to run."""
        now = self._sample()
        if now[0] - self._last[0] < _MIN_WINDOW_S:
            return self.threads
        others = self.others_busy(self._last, now)
        self._last = now
        if others is None:
            self.threads = self.base
        else:
            idle = int(self.cores - others - self.base + (1 - _IDLE_FRACTION))
            self.threads = max(self.base, min(self.most, self.base + idle))
            self.decisions += 1
            self.wider += self.threads > self.base
            self.others_total += others
        d0, w0, o0 = self._reported_counts
        decisions = self.decisions - d0
        if now[0] - self._reported >= _REPORT_S and decisions:
            logger.info("prefill passes: %d of %d decisions in the last %.0f s took idle cores "
                        "(the rest of the machine used %.2f cores on average)",
                        self.wider - w0, decisions, now[0] - self._reported,
                        (self.others_total - o0) / decisions)
            self._reported = now[0]
            self._reported_counts = (self.decisions, self.wider, self.others_total)
        return self.threads

    def stats(self) -> dict[str, float]:
        """Since start: passes decided on a load sample, those that took idle cores, and the
        cores the rest of the machine used on average before them."""
        n = self.decisions
        return {"idle_core_decisions": n, "idle_core_wider_passes": self.wider,
                "idle_core_others_mean": self.others_total / n if n else 0.0}

    @contextmanager
    def pass_threads(self):
        """Run a pass on :meth:`next_pass` threads, then go back to ``base``."""
        threads = self.next_pass()
        with on_threads(threads):
            yield threads


@contextmanager
def on_threads(threads: int | None):
    """Run a block on ``threads`` threads (torch's and the engine's kernels' count on the
    calling thread; None: as they are), then go back to the count before."""
    if threads is None:  # a mixed step's, each step of a replica without decode_threads
        yield
        return
    before = torch.get_num_threads()
    if threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
