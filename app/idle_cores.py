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

A window that long says what the machine did, not what it does: a lone request's prompt
arrives just after the stream before it ended, so the seconds since the previous pass show
the decode core busy though it is idle now. A window over ``_STALE_S`` is therefore checked
against the moment: the threads the kernel has running or waiting to run now
(``/proc/loadavg``, read a few times over a couple of milliseconds, the fewest taken), less
this one; where none is, the idle cores are taken (a lone 64-token prompt on SmolLM2: 39-43
ms on two threads against 72 ms on one, the whole first token 101 ms).

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

# a window shorter than this says little (the kernel counts CPU time in 10 ms ticks, so one
# tick in a 50 ms window reads as a fifth of a core): the last decision stands, for the rest
# of a pass that runs in slices too
_MIN_WINDOW_S = 0.2
# a core counts as idle when the others left at least this much of it
_IDLE_FRACTION = 0.75
# how often the replica's log says how its passes' threads went
_REPORT_S = 30.0
# a window longer than this is checked against the threads running now
_STALE_S = 0.5
# reads of /proc/loadavg for that check, this far apart: the fewest running is taken (a
# thread of the stack passing through one read is not a core in use; a decode step runs
# through all of them)
_NOW_READS, _NOW_GAP_S = 3, 0.001

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


def others_running(loadavg: Path, reads: int = _NOW_READS, gap_s: float = _NOW_GAP_S,
                   ) -> int | None:
    """Threads other than the caller that the kernel has running or runnable now (the fewest
    of ``reads`` reads of ``/proc/loadavg``, ``gap_s`` apart), or None where it cannot say."""
    fewest = None
    for i in range(reads):
        if i:
            time.sleep(gap_s)
        try:
            running = int(loadavg.read_text().split()[3].split("/")[0])
        except (OSError, IndexError, ValueError):
            return None
        fewest = running if fewest is None else min(fewest, running)
    return None if fewest is None else max(0, fewest - 1)


class IdleCores:
    """How many threads the next pass may use: ``base`` plus the cores the rest of the
    machine left idle since the previous pass (after a pause over ``_STALE_S``: the cores
    idle now), at most ``most``."""

    def __init__(self, base: int, most: int, stat: Path = Path("/proc/stat"),
                 loadavg: Path = Path("/proc/loadavg")) -> None:
        assert 1 <= base <= most
        self.base, self.most, self.stat, self.loadavg = base, most, stat, loadavg
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
        stale = now[0] - self._last[0] > _STALE_S
        self._last = now
        if others is None:
            self.threads = self.base
        else:
            idle = int(self.cores - others - self.base + (1 - _IDLE_FRACTION))
            if idle < 1 and stale and self.most > self.base:
                running = others_running(self.loadavg)
                if running is not None:  # what runs now, not what ran in the window
                    idle = self.cores - running - self.base
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
