"""One run of a system on a list of arrivals (``simulate``)."""

from __future__ import annotations

from collections.abc import Sequence

from planner.sim.colocated import _ColocatedRun
from planner.sim.engine import _Clock, _Req, _Seq
from planner.sim.metrics import SimResult
from planner.sim.split import _SplitRun
from planner.sim.systems import SplitSystem, System
from planner.sim.workload import Arrival


class Simulation:
    """One run of a system on a list of arrivals."""

    def __init__(self, system: System, arrivals: Sequence[Arrival]) -> None:
        self.system = system
        self.arrivals = sorted(arrivals, key=lambda a: a.at)
        self.clock = _Clock()
        self.done: list[_Req] = []

    def run(self) -> SimResult:
        replicas: _SplitRun | _ColocatedRun
        if isinstance(self.system, SplitSystem):
            replicas = _SplitRun(self.system, self.clock, self._finish)
        else:
            replicas = _ColocatedRun(self.system, self.clock, self._finish)
        replicas.schedule_arrivals(self.arrivals)
        self.clock.run()
        return SimResult.build(self.system, self.done, replicas.busy_devices())

    def _finish(self, s: _Seq) -> None:
        s.req.finished += 1
        if s.req.finished == s.req.arrival.n:
            self.done.append(s.req)



def simulate(system: System, arrivals: Sequence[Arrival]) -> SimResult:
    return Simulation(system, arrivals).run()
