"""The engine thread's CPU priority (EngineConfig.nice, app.engine_core): the thread that runs
every pass, and the OpenMP workers it starts, run at the configured nice; a nice the OS
refuses is logged and the thread keeps its own."""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import pytest
import torch

from app import engine_core
from app.config import EngineConfig
from app.engine_core import EngineCore, thread_nice
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.skipif(not hasattr(os, "getpriority"), reason="needs Linux priorities")


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _nice_of(tid: int) -> int | None:
    """Thread ``tid``'s nice, or None where it has exited since it was listed."""
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except ProcessLookupError:
        return None


def _parallel_work() -> None:
    """A parallel op on the calling thread (its OpenMP team of two is started here, if new)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(512, 512)
        for _ in range(4):
            a = torch.tanh(a @ a)
    finally:
        torch.set_num_threads(before)


def test_passes_run_at_the_configured_nice_and_so_do_their_workers(tiny_model):
    own = thread_nice()
    nice = min(19, own + 3)
    core = EngineCore(EngineConfig(nice=nice), model=tiny_model)
    assert core.nice == nice
    assert asyncio.run(core.run(thread_nice)) == nice
    assert thread_nice() == own  # the caller's thread keeps its priority
    before = _threads()
    asyncio.run(core.run(_parallel_work))
    started = _threads() - before
    # the workers the engine thread started for its first parallel op
    assert started
    assert all(os.getpriority(os.PRIO_PROCESS, tid) == nice for tid in started)
    core.thread.shutdown()


def test_no_nice_leaves_the_processs_priority(tiny_model):
    core = EngineCore(EngineConfig(), model=tiny_model)
    assert core.nice == thread_nice()
    core.thread.shutdown()


def test_a_refused_nice_is_logged_and_the_thread_keeps_its_own(tiny_model, monkeypatch,
                                                               caplog):
    own = thread_nice()

    def refuse(*args):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(engine_core.os, "setpriority", refuse)
    with caplog.at_level(logging.WARNING, logger="app.engine_core"):
        core = EngineCore(EngineConfig(nice=-10), model=tiny_model)
    assert core.nice == own
    assert any("nice -10 refused" in r.getMessage() and "CAP_SYS_NICE" in r.getMessage()
               for r in caplog.records)
    core.thread.shutdown()


@pytest.mark.parametrize("nice", [-21, 20])
def test_a_nice_out_of_range_is_refused(nice):
    with pytest.raises(ValueError, match=r"nice must be in -20\.\.19"):
        EngineConfig(nice=nice)


def test_a_loaded_model_starts_one_openmp_team_the_engine_threads(tmp_path):
    """Loading, packing the weights and every pass run on the engine thread, so the
    process has one OpenMP team (more pool threads than cores would put libgomp's workers
    to sleep at every region's end). The engine thread runs at a nice of its own, which the
    workers it starts inherit: a team the constructor's thread started would not."""
    # weights wide enough that packing them runs parallel ops
    make_tiny_model(hidden_size=256, intermediate_size=1024).save_pretrained(tmp_path)
    own = thread_nice()
    nice = min(19, own + 3)
    out: dict = {}

    def construct() -> None:  # a fresh thread, as a replica's constructor runs on
        before = _threads()
        core = EngineCore(EngineConfig(model=str(tmp_path), nice=nice, num_threads=2))
        engine = core.thread.submit(threading.get_native_id).result()
        # while this thread lives: a team it started would still be there
        out["core"] = core
        out["workers"] = {tid: n for tid in _threads() - before - {engine}
                          if (n := _nice_of(tid)) is not None}

    thread = threading.Thread(target=construct)
    thread.start()
    thread.join()
    core = out["core"]
    assert out["workers"]  # packing the weights ran parallel ops: the engine thread's team
    assert set(out["workers"].values()) == {nice}
    before = _threads()
    asyncio.run(core.run(_parallel_work))
    assert _threads() - before == set()  # passes reuse that team
    core.thread.shutdown()
