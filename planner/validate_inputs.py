"""What ``planner validate`` builds from its arguments: the measured engines, the serving
stacks fitted on them, the split's shared machine and its passes on idle cores."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from planner.hardware import DeviceProfile
from planner.sim import EngineLimits


def engine_devices(args: argparse.Namespace) -> dict[str, DeviceProfile]:
    """The measured devices, with the engine fits of ``--engine-profile``, slowed by
    ``--slowdown``: the engines alone, no serving stack."""
    from planner.profile import load_devices

    devices = load_devices(args.profile)
    for path in args.engine_profile:
        for name, dev in load_devices(path).items():
            if name in devices:
                devices[name] = dataclasses.replace(devices[name], prefill=dev.prefill,
                                                    decode=dev.decode,
                                                    source=f"{path}: {dev.source}")
    return {n: d.slowed(args.slowdown) for n, d in devices.items()}


def validation_devices(engines: dict[str, DeviceProfile],
                        args: argparse.Namespace) -> dict[str, DeviceProfile]:
    """``engines`` (``engine_devices``) plus the serving stacks of ``--stack-split`` /
    ``--stack-colocated``."""
    devices = dict(engines)
    for name, path, hop in (("cpu-1t", args.stack_split, True),
                            ("cpu-2t", args.stack_colocated, False)):
        if path:
            devices[name] = _with_stack(devices[name], name, path, hop)
    return devices


def shared_cores(args: argparse.Namespace,
                  engine: DeviceProfile | None) -> tuple[float | None, float]:
    """The split's machine (``SplitSystem.shared_cores``) and the cores its stack keeps busy
    while tokens stream (``stack_cores``), from ``--stack-split``'s CPU figures and
    ``engine`` (its replicas' engine alone); (None, 0) with ``--own-cores`` or a stack file
    without them."""
    from planner.profile import stack_cores

    if args.own_cores or not args.stack_split or engine is None:
        return None, 0.0
    stack = json.loads(Path(args.stack_split).read_text())
    busy = stack_cores(engine, stack)
    if busy is None or not stack.get("cores"):
        print(f"{args.stack_split} has no CPU figures: the split's phases get a core each")
        return None, 0.0
    print(f"split: its phases and the serving stack share {stack['cores']} cores; the stack "
          f"keeps {busy:.2f} of them busy while tokens stream")
    return float(stack["cores"]), busy


def split_wide(args: argparse.Namespace, engines: dict[str, DeviceProfile],
                limits: EngineLimits, cores: float | None) -> DeviceProfile | None:
    """The split's prefill engine on ``prefill_max_threads`` threads, for a pass alone on
    the shared machine (``SplitSystem.prefill_wide``): its ``cpu-Nt`` profile, the engine's
    own time (fitting ``--stack-split``'s lone prompts against it gave v13 a slope of 1.5
    and a negative intercept: wide passes slower than one thread, 64-token prompts 2.4x too
    slow); None where the split does not share cores or has no such profile."""
    threads = limits.prefill_max_threads
    if not args.split or cores is None or threads < 2:
        return None
    engine = engines.get(f"cpu-{threads}t")
    if engine is None:
        print(f"split: no cpu-{threads}t profile: a pass alone on the machine is not "
              "modelled on its idle cores (prefill_max_threads)")
        return None
    print(f"split: a prefill pass alone on the machine takes {threads} threads "
          f"(prefill_max_threads): cpu-{threads}t, {engine.source}")
    return engine


def _with_stack(device: DeviceProfile, name: str, path: str, hop: bool) -> DeviceProfile:
    from planner.profile import stack_device

    fitted = stack_device(device, json.loads(Path(path).read_text()), hop=hop)
    print(f"{name} with the serving stack of {path}: decode step + "
          f"{fitted.decode_stack.c0 * 1000:.1f} ms + "
          f"{fitted.decode_stack.c1 * 1000:.1f} ms x batch; "
          f"{fitted.request_overhead_s * 1000:.0f} ms per request; a lone prompt's pass "
          f"x{fitted.prefill_slowdown / device.prefill_slowdown:.2f}")
    return fitted
