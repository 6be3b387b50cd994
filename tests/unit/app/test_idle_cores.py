"""Threads for a prefill pass from the cores the rest of the machine leaves idle
(app.idle_cores): the machine's busy time less this process's own, between passes."""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from app import idle_cores
from app.config import EngineConfig
from app.idle_cores import IdleCores
from app.messages import PrefillRequest
from app.model_runner import ModelRunner
from app.prefill import Prefiller
from app.sampling import SamplingParams
from tests.conftest import make_tiny_model

TICK = os.sysconf("SC_CLK_TCK")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


class FakeMachine:
    """/proc/stat and the clocks IdleCores reads, advanced by hand."""

    def __init__(self, tmp_path, monkeypatch):
        self.stat = tmp_path / "stat"
        self.wall = self.own = self.busy = 0.0
        self.idle = 0.0
        self.write()
        monkeypatch.setattr(idle_cores.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(idle_cores.time, "process_time", lambda: self.own)

    def write(self):
        user = round(self.busy * TICK)
        self.stat.write_text(f"cpu  {user} 0 0 {round(self.idle * TICK)} 0 0 0 0 0 0\n"
                             "cpu0 0 0 0 0 0 0 0 0 0 0\n")

    def run(self, seconds, own_cores, other_cores, cores=2):
        self.wall += seconds
        self.own += seconds * own_cores
        self.busy += seconds * (own_cores + other_cores)
        self.idle += seconds * (cores - own_cores - other_cores)
        self.write()


def test_a_pass_takes_the_cores_the_others_leave_idle(tmp_path, monkeypatch):
    m = FakeMachine(tmp_path, monkeypatch)
    cores = IdleCores(1, 2, stat=m.stat)
    cores.cores = 2
    m.run(1.0, own_cores=1.0, other_cores=0.05)  # decode idle: its core is free
    assert cores.next_pass() == 2
    m.run(1.0, own_cores=2.0, other_cores=0.0)  # our own two threads are not "others"
    assert cores.next_pass() == 2
    m.run(1.0, own_cores=1.0, other_cores=0.9)  # decode streaming: keep to one thread
    assert cores.next_pass() == 1
    m.run(0.01, own_cores=0.0, other_cores=0.0)  # too short a window to say: unchanged
    assert cores.next_pass() == 1
    m.run(1.0, own_cores=1.0, other_cores=0.4)  # more than a quarter of a core in use
    assert cores.next_pass() == 1
    m.run(1.0, own_cores=1.0, other_cores=0.2)
    assert cores.next_pass() == 2
    # the replica's stats: five decisions on a load sample (not the too-short window), three
    # of them wider, and the others' load averaged over those five
    stats = cores.stats()
    assert stats["idle_core_decisions"] == 5
    assert stats["idle_core_wider_passes"] == 3
    assert abs(stats["idle_core_others_mean"] - (0.05 + 0 + 0.9 + 0.4 + 0.2) / 5) < 0.02


def test_no_stat_file_keeps_to_the_configured_threads(tmp_path, monkeypatch):
    m = FakeMachine(tmp_path, monkeypatch)
    cores = IdleCores(1, 2, stat=tmp_path / "missing")
    m.run(1.0, own_cores=1.0, other_cores=0.0)
    assert cores.next_pass() == 1


def test_pass_threads_sets_torch_threads_on_the_calling_thread_only_for_the_pass(
        tmp_path, monkeypatch):
    m = FakeMachine(tmp_path, monkeypatch)
    seen = {}

    def engine_thread():
        torch.set_num_threads(1)
        cores = IdleCores(1, 2, stat=m.stat)
        cores.cores = 2
        m.run(1.0, own_cores=1.0, other_cores=0.0)
        with cores.pass_threads() as n:
            seen["during"] = (n, torch.get_num_threads())
        seen["after"] = torch.get_num_threads()

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join(timeout=60)
    assert seen == {"during": (2, 2), "after": 1}


def test_the_prefiller_runs_passes_through_it_when_configured(tmp_path, monkeypatch):
    m = FakeMachine(tmp_path, monkeypatch)
    model = make_tiny_model(seed=2)
    plain = Prefiller(ModelRunner(model, EngineConfig(num_threads=1)), "fp")
    assert plain.idle_cores is None
    prefiller = Prefiller(ModelRunner(model, EngineConfig(num_threads=1,
                                                          prefill_max_threads=2)), "fp")
    assert (prefiller.idle_cores.base, prefiller.idle_cores.most) == (1, 2)
    prefiller.idle_cores.stat = m.stat
    prefiller.idle_cores._last = prefiller.idle_cores._sample()
    prefiller.idle_cores.cores = 2
    threads = []
    real = prefiller.runner.prefill_layers

    def spy(*args, **kwargs):
        inner = real(*args, **kwargs)

        def steps():  # the threads the pass's layers run on
            threads.append(torch.get_num_threads())
            return (yield from inner)
        return steps()

    monkeypatch.setattr(prefiller.runner, "prefill_layers", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m.run(1.0, own_cores=1.0, other_cores=0.0)  # the other core idle
        [alone] = prefiller.make_packages([PrefillRequest("a", tuple(range(3, 40)), GREEDY)])
        m.run(1.0, own_cores=1.0, other_cores=1.0)  # now busy
        [busy] = prefiller.make_packages([PrefillRequest("b", tuple(range(3, 40)), GREEDY)])
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert threads == [2, 1] and after == 1
    # the same prompt's package, whichever thread count computed it
    np.testing.assert_allclose(alone.kv, busy.kv, rtol=1e-5, atol=1e-5)
    assert alone.first_token == busy.first_token


def test_the_log_says_how_often_passes_took_idle_cores(tmp_path, monkeypatch, caplog):
    m = FakeMachine(tmp_path, monkeypatch)
    cores = IdleCores(1, 2, stat=m.stat)
    cores.cores = 2
    with caplog.at_level("INFO", logger="app.idle_cores"):
        m.run(10.0, own_cores=1.0, other_cores=0.0)
        cores.next_pass()
        m.run(25.0, own_cores=1.0, other_cores=1.0)
        cores.next_pass()
    [record] = [r for r in caplog.records if r.name == "app.idle_cores"]
    assert record.getMessage().startswith("prefill passes: 1 of 2 decisions in the last 35 s")
    assert "used 0.50 cores on average" in record.getMessage()  # 0 and 1 core, per decision
