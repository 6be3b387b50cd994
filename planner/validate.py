"""Replay real load-test runs through the simulator and compare: predicted vs measured.

Each run of a load generator ``results.json`` is replayed with its own arrivals (send times,
prompt and output lengths), so the comparison is not blurred by two different draws of a
Poisson process. The split app (``serve_configs/local.yaml``) is one prefill and one decode
replica of one torch thread each (``cpu-1t``); the colocated baseline one replica of two
threads (``cpu-2t``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from load_tests.metrics import RequestRecord, summarize
from planner.hardware import DeviceProfile
from planner.sim import (
    ColocatedSystem,
    EngineLimits,
    SplitSystem,
    System,
    simulate,
    trace_of_run,
)


def limits_of_app(config: str | Path, base: EngineLimits | None = None) -> EngineLimits:
    """The engine's bounds and the split's routing as a Serve config sets them (its first
    application's args, defaults filled by ``AppArgs``), over ``base`` (the simulator-only
    fields: KV layout, block size, prefill routing)."""
    from deployments.args import AppArgs  # pydantic and Ray Serve's schema: only when asked

    apps = (yaml.safe_load(Path(config).read_text()) or {}).get("applications") or []
    if not apps:
        raise ValueError(f"{config}: no applications")
    return EngineLimits.from_app_args(AppArgs.model_validate(apps[0].get("args") or {}), base)


METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90"))


def local_system(kind: str, devices: dict[str, DeviceProfile],
                 limits: EngineLimits | None = None, policy: str = "mixed",
                 shared_cores: float | None = None, stack_cores: float = 0.0,
                 prefill_wide: DeviceProfile | None = None) -> System:
    """``policy``: the colocated replica's, and the split decode replicas' for the prompts
    they prefill (``mixed``: ``engine.mixed_batch``, the default; ``interleave``: off).
    ``shared_cores``, ``stack_cores``, ``prefill_wide``: the split's phases and the serving
    stack on one machine (``SplitSystem``'s); None: a core per phase, the stack aside."""
    limits = limits or EngineLimits()
    if kind == "split":
        return SplitSystem(devices["cpu-1t"], devices["cpu-1t"], 1, 1, limits,
                           decode_policy=policy, shared_cores=shared_cores,
                           stack_cores=stack_cores,
                           prefill_wide=prefill_wide if shared_cores is not None else None)
    if kind == "colocated":
        return ColocatedSystem(devices["cpu-2t"], 1, limits, policy)
    raise ValueError(f"unknown system kind {kind!r}")


def compare_run(system: System, run: dict[str, Any], slos: dict[str, float]) -> dict[str, Any]:
    """Predicted and measured figures of one load-generator run, with relative errors."""
    recs = [RequestRecord(r["class"], r["sent_at"], r["prompt_tokens"], r["output_tokens"],
                          r["ttft_s"], r["e2e_s"], r.get("itl_s") or [], r["ok"], r["error"])
            for r in run["requests"]]
    duration = run["summary"]["overall"]["duration_s"]
    measured = summarize(recs, duration, slos)
    predicted = simulate(system, trace_of_run(run)).summary(slos)
    rows = {}
    for metric, q in METRICS:
        m, p = measured[metric][q], predicted[metric][q]
        rows[f"{metric[:-3]} {q}"] = (m, p)
    rows["goodput"] = (measured["goodput"], predicted["goodput"])
    return {
        "rate": run.get("rate"),
        "requests": len(recs),
        "rows": {k: {"measured": m, "predicted": p,
                     "error": None if not m else (p - m) / m} for k, (m, p) in rows.items()},
    }


def validate(devices: dict[str, DeviceProfile], results: dict[str, str | Path],
             slos: dict[str, float] | None = None,
             limits: EngineLimits | dict[str, EngineLimits] | None = None,
             policy: str = "mixed", shared_cores: float | None = None,
             stack_cores: float = 0.0,
             prefill_wide: DeviceProfile | None = None) -> list[dict[str, Any]]:
    """``results``: system kind (``split``/``colocated``) -> results.json path; ``limits``:
    the engine's (default ``EngineLimits()``: this engine, paged KV), one for both kinds or
    per kind (``limits_of_app`` of each run's serve config); ``policy``, ``shared_cores``,
    ``stack_cores``, ``prefill_wide``: as ``local_system``'s."""
    out = []
    for kind, path in results.items():
        data = json.loads(Path(path).read_text())
        run_slos = slos if slos is not None else data["config"].get("slos_ms") or {}
        kind_limits = limits.get(kind) if isinstance(limits, dict) else limits
        system = local_system(kind, devices, kind_limits, policy, shared_cores,
                              stack_cores, prefill_wide)
        for run in data["runs"]:
            out.append({"system": kind, "slos_ms": run_slos,
                        **compare_run(system, run, run_slos)})
    return out


def table(comparisons: list[dict[str, Any]]) -> str:
    keys = list(comparisons[0]["rows"]) if comparisons else []
    head = "| system | rate/s | " + " | ".join(keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 2)]
    for c in comparisons:
        cells = []
        for k in keys:
            r = c["rows"][k]
            m, p, e = r["measured"], r["predicted"], r["error"]
            digits = 2 if k == "goodput" else 0
            err = "-" if e is None else f"{e * 100:+.0f}%"
            cells.append(f"{m:.{digits}f} / {p:.{digits}f} ({err})" if m is not None
                         and p is not None else "-")
        lines.append(f"| {c['system']} | {c['rate']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
