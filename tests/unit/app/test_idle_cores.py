"""Threads for a prefill pass from the cores the rest of the machine leaves idle
(app.idle_cores): the machine's busy time less this process's own, between passes, and
after a long pause the threads running at the moment."""

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
        self.loadavg = tmp_path / "loadavg"
        self.wall = self.own = self.busy = 0.0
        self.idle = 0.0
        self.running_now = 0  # threads other than the caller running at the moment
        self.write()
        monkeypatch.setattr(idle_cores.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(idle_cores.time, "process_time", lambda: self.own)

    def write(self):
        user = round(self.busy * TICK)
        self.stat.write_text(f"cpu  {user} 0 0 {round(self.idle * TICK)} 0 0 0 0 0 0\n"
                             "cpu0 0 0 0 0 0 0 0 0 0 0\n")
        # the caller counts itself among the running
        self.loadavg.write_text(f"0.50 0.40 0.30 {1 + self.running_now}/300 4242\n")

    def run(self, seconds, own_cores, other_cores, cores=2, running_now=None):
        """``seconds`` more with the loads given; ``running_now``: the others' threads
        running at its end (None: the others' load, rounded)."""
        self.wall += seconds
        self.own += seconds * own_cores
        self.busy += seconds * (own_cores + other_cores)
        self.idle += seconds * (cores - own_cores - other_cores)
        self.running_now = round(other_cores) if running_now is None else running_now
        self.write()

    def cores(self, base=1, most=2):
        cores = IdleCores(base, most, stat=self.stat, loadavg=self.loadavg)
        cores.cores = 2
        return cores


def test_a_pass_takes_the_cores_the_others_leave_idle(tmp_path, monkeypatch):
    m = FakeMachine(tmp_path, monkeypatch)
    cores = m.cores()
    # windows under _STALE_S: what the others used in them decides
    m.run(0.4, own_cores=1.0, other_cores=0.05)  # decode idle: its core is free
    assert cores.next_pass() == 2
    m.run(0.4, own_cores=2.0, other_cores=0.0)  # our own two threads are not "others"
    assert cores.next_pass() == 2
    m.run(0.4, own_cores=1.0, other_cores=0.9)  # decode streaming: keep to one thread
    assert cores.next_pass() == 1
    m.run(0.01, own_cores=0.0, other_cores=0.0)  # too short a window to say: unchanged
    assert cores.next_pass() == 1
    m.run(0.4, own_cores=1.0, other_cores=0.4)  # more than a quarter of a core in use
    assert cores.next_pass() == 1
    m.run(0.4, own_cores=1.0, other_cores=0.2)
    assert cores.next_pass() == 2
    # the replica's stats: five decisions on a load sample (not the too-short window), three
    # of them wider, and the others' load averaged over those five
    stats = cores.stats()
    assert stats["idle_core_decisions"] == 5
    assert stats["idle_core_wider_passes"] == 3
    assert abs(stats["idle_core_others_mean"] - (0.05 + 0 + 0.9 + 0.4 + 0.2) / 5) < 0.02


def test_no_stat_file_keeps_to_the_configured_threads(tmp_path, monkeypatch):
    m = FakeMachine(tmp_path, monkeypatch)
    cores = IdleCores(1, 2, stat=tmp_path / "missing", loadavg=m.loadavg)
    m.run(1.0, own_cores=1.0, other_cores=0.0)
    assert cores.next_pass() == 1


def test_after_a_long_window_the_threads_running_now_decide(tmp_path, monkeypatch):
    m = FakeMachine(tmp_path, monkeypatch)
    cores = m.cores()
    # a lone request's prompt: the stream before it kept the decode core busy for the
    # seconds since the last pass, and has ended: nothing else runs now
    m.run(1.8, own_cores=0.0, other_cores=1.0, running_now=0)
    assert cores.next_pass() == 2
    # the pass's next slice, 0.1 s on: a tick or two of the stack's is no reason to change
    m.run(0.1, own_cores=2.0, other_cores=0.3, running_now=0)
    assert cores.next_pass() == 2
    # the same window with the decode thread running now
    m.run(1.8, own_cores=0.0, other_cores=1.0, running_now=1)
    assert cores.next_pass() == 1
    # a short busy window is not second-guessed by a quiet moment (a decode step's gap)
    m.run(0.3, own_cores=1.0, other_cores=1.0, running_now=0)
    assert cores.next_pass() == 1
    # where the moment cannot be read, the window's answer stands
    cores.loadavg = tmp_path / "missing"
    m.run(1.8, own_cores=0.0, other_cores=1.0, running_now=0)
    assert cores.next_pass() == 1


def test_the_moment_is_the_fewest_running_of_a_few_reads(tmp_path, monkeypatch):
    path = tmp_path / "loadavg"
    seen = iter([3, 2, 4])  # the caller and two others, then one, then three

    def sleep(_s):
        path.write_text(f"0 0 0 {next(seen)}/9 1\n")

    sleep(0)
    monkeypatch.setattr(idle_cores.time, "sleep", sleep)
    assert idle_cores.others_running(path) == 1
    path.write_text("garbage\n")
    assert idle_cores.others_running(path) is None
    assert idle_cores.others_running(tmp_path / "missing") is None


def test_pass_threads_sets_torch_threads_on_the_calling_thread_only_for_the_pass(
        tmp_path, monkeypatch):
    m = FakeMachine(tmp_path, monkeypatch)
    seen = {}

    def engine_thread():
        torch.set_num_threads(1)
        cores = m.cores()
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
    prefiller.idle_cores.stat, prefiller.idle_cores.loadavg = m.stat, m.loadavg
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
    cores = m.cores()
    with caplog.at_level("INFO", logger="app.idle_cores"):
        m.run(10.0, own_cores=1.0, other_cores=0.0)
        cores.next_pass()
        m.run(25.0, own_cores=1.0, other_cores=1.0)
        cores.next_pass()
    [record] = [r for r in caplog.records if r.name == "app.idle_cores"]
    assert record.getMessage().startswith("prefill passes: 1 of 2 decisions in the last 35 s")
    assert "used 0.50 cores on average" in record.getMessage()  # 0 and 1 core, per decision
