"""The colocated system: one engine per replica for both phases."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from planner.hardware import DeviceProfile
from planner.sim.engine import _Busy, _Clock, _Req, _Seq
from planner.sim.replicas import _Engines
from planner.sim.systems import ColocatedSystem
from planner.sim.workload import Arrival


class _ColocatedRun(_Engines):
    """The colocated replicas on a clock: each prompt goes to the least loaded replica,
    which prefills it and decodes its answer (``_Engines``)."""

    def __init__(self, sysm: ColocatedSystem, clock: _Clock,
                 finish: Callable[[_Seq], None]) -> None:
        super().__init__(sysm.device, sysm.num_replicas, sysm.limits, sysm.policy, clock,
                         finish, sysm.chunk_tokens)
        self.sysm = sysm

    def schedule_arrivals(self, arrivals: Iterable[Arrival]) -> None:
        overhead = self.device.request_overhead_s
        for uid, a in enumerate(arrivals):
            r = _Req(a, a.at, uid, local=True)
            self.clock.at(a.at + overhead, lambda r=r: self.request_arrive(r))

    def busy_devices(self) -> list[tuple[DeviceProfile, _Busy]]:
        return [(self.device, b) for b in self.busy]

    def request_arrive(self, r: _Req) -> None:
        self.add_prompt(self.least_loaded(), r)
