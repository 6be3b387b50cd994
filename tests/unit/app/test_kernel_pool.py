"""The kernels' own thread team (app/csrc/pool.c, through its check sk_pool_selftest): every
task of a parallel loop runs exactly once, on a worker of the loop's team, over thousands of
loops in a row (the job slots' reuse), with more threads than tasks, from several calling
threads at once (each its own team), and with none."""

from __future__ import annotations

import ctypes
import threading

import pytest

from app import cpu_kernels
from app.cpu_kernels import kernel_unavailable

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason="the kernels need x86-64 with AVX2/FMA and a compiler")


def _loop(tasks: int, threads: int) -> tuple[list[int], list[int]]:
    lib = cpu_kernels.load_kernel()
    owner = (ctypes.c_long * max(tasks, 1))()
    runs = (ctypes.c_long * max(tasks, 1))()
    for i in range(tasks):
        owner[i] = -1
    cpu_kernels.check(lib.sk_pool_selftest(tasks, threads, ctypes.addressof(owner),
                                           ctypes.addressof(runs)), "sk_pool_selftest")
    return list(owner[:tasks]), list(runs[:tasks])


@pytest.mark.parametrize("tasks,threads", [(1, 1), (7, 1), (1, 2), (3, 4), (64, 2), (997, 3)])
def test_every_task_runs_once_on_a_worker_of_the_team(tasks, threads):
    owner, runs = _loop(tasks, threads)
    assert runs == [1] * tasks
    assert all(0 <= w < min(threads, tasks) for w in owner), owner


def test_thousands_of_loops_in_a_row_each_run_every_task_once():
    """Two job slots used in turn: a helper late for one loop must not run a task of the
    next (a task run twice or skipped shows in runs)."""
    seen_workers: set[int] = set()
    for i in range(3000):
        owner, runs = _loop(5 + i % 40, 2)
        assert runs == [1] * len(runs), i
        seen_workers.update(owner)
    assert seen_workers <= {0, 1}


def test_calling_threads_at_once_each_get_their_own_team():
    errors: list[str] = []

    def caller(index: int) -> None:
        for i in range(300):
            owner, runs = _loop(50 + index, 2)
            if runs != [1] * len(runs) or not all(w in (0, 1) for w in owner):
                errors.append(f"caller {index}, loop {i}: runs {runs}, owner {owner}")
                return

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_no_tasks_and_bad_arguments():
    assert _loop(0, 2) == ([], [])
    lib = cpu_kernels.load_kernel()
    with pytest.raises(cpu_kernels.KernelError, match="sk_pool_selftest"):
        cpu_kernels.check(lib.sk_pool_selftest(4, 0, 0, 0), "sk_pool_selftest")
