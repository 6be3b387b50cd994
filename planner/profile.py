"""Measure this machine: the engine's prefill and decode passes and the KV hop, as a profile.

Engine passes run in this process on the app's own code (``EngineCore``: the runner, the
prefiller with its KV packages and first-token sampling), once per thread count (a split-app
replica uses 1 torch thread here, the colocated replica 2). The KV hop is timed on a small
local Ray cluster (``ray.cluster_utils.Cluster``, a head plus one worker node): an actor puts a
numpy array the size of a KV package, another actor gets it, on the same node or on the other
one. The result is one :class:`~planner.hardware.DeviceProfile` per thread count,
fitted by least squares, plus the raw points, in a JSON file.

Starting Ray needs the machine lock::

    flock /tmp/splitserve-ray-cluster.lock python -m planner profile --out P.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from planner.hardware import DeviceProfile, Linear, PassCost

PREFILL_POINTS = ((1, 16), (1, 64), (1, 128), (1, 256), (1, 512), (1, 1024), (2, 256),
                  (4, 64), (4, 256), (8, 128))
DECODE_POINTS = tuple((b, s) for b in (1, 2, 4, 8, 16) for s in (64, 256, 1024))
HOP_SIZES = (1 << 10, 1 << 16, 1 << 20, 4 << 20, 16 << 20, 64 << 20)

# A CPU slice has no power meter here: figures per busy / idle core are assumptions of a
# server-class x86 core (about 10 W busy, 2 W idle), and the price is a typical on-demand
# vCPU-hour (e.g. AWS c7i, about $0.045 per vCPU-hour in 2025).
CPU_WATTS_BUSY_PER_CORE = 10.0
CPU_WATTS_IDLE_PER_CORE = 2.0
CPU_PRICE_PER_CORE_HOUR = 0.045


def fit_linear(x1: Sequence[float], x2: Sequence[float], y: Sequence[float]) -> Linear:
    """Least squares ``y ~ c0 + c1 x1 + c2 x2`` with non-negative slopes (a pass never gets
    cheaper with more work: a negative slope is noise, refit without that feature)."""
    a = np.column_stack([np.ones(len(y)), np.asarray(x1, float), np.asarray(x2, float)])
    yv = np.asarray(y, float)
    keep = [0, 1, 2]
    while True:
        sub, *_ = np.linalg.lstsq(a[:, keep], yv, rcond=None)
        coef = np.zeros(3)
        coef[keep] = sub
        negative = [i for i in keep[1:] if coef[i] < 0]
        if not negative:
            break
        keep.remove(min(negative, key=lambda i: coef[i] * np.abs(a[:, i]).max()))
    return Linear(float(coef[0]), float(coef[1]), float(coef[2]))


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_engine(num_threads: int, *, repeats: int = 3, model: str | None = None,
                   quick: bool = False, worker_thread: bool = True,
                   dtype: str = "auto", weights: str | None = None) -> dict[str, Any]:
    """Time prefill and decode passes of the app's engine with ``num_threads`` torch threads.

    By default on the engine's own thread, which also loaded the model, as a replica runs
    them (``EngineCore.thread``); ``worker_thread=False`` times them on the calling thread.
    """
    from app.config import DEFAULT_MODEL, EngineConfig
    from app.engine_core import EngineCore

    core = EngineCore(EngineConfig(model=model or DEFAULT_MODEL, num_threads=num_threads,
                                   dtype=dtype,  # auto: what the serve configs run
                                   weights=weights))  # int8: weight-only int8 panels
    if not worker_thread:
        return _time_passes(core, num_threads, repeats, quick)
    result = core.thread.submit(_time_passes, core, num_threads, repeats, quick).result()
    return {**result, "thread": "worker"}


def _time_passes(core: Any, num_threads: int, repeats: int, quick: bool) -> dict[str, Any]:
    import torch

    from app.fingerprint import model_dtype
    from app.kv_cache import DEFAULT_BLOCK_SIZE, contiguous_tables
    from app.messages import PrefillRequest
    from app.prefill import Prefiller
    from app.sampling import SamplingParams

    cfg = core.config
    torch.set_num_threads(num_threads)
    # cold passes: no prefix cache, and prompts never seen before in every repeat (the
    # planner models prefix hits as a workload parameter; a repeat served from the cache
    # would time a near-empty pass)
    prefiller = Prefiller(core.runner, core.fingerprint, None)
    runner = core.runner
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_tokens=2, temperature=0.0)

    def requests(rows: int, n: int) -> list[PrefillRequest]:
        return [PrefillRequest(f"r{i}", tuple(int(t) for t in rng.integers(100, 20000, n)),
                               greedy) for i in range(rows)]

    prefill_points = PREFILL_POINTS[::2] if quick else PREFILL_POINTS
    decode_points = DECODE_POINTS[::2] if quick else DECODE_POINTS
    prefiller.make_packages(requests(1, 32))  # first-call costs (thread pools, allocations)
    prefill = []
    for rows, n in prefill_points:
        fresh = iter([requests(rows, n) for _ in range(repeats)])
        t = _median_time(lambda fresh=fresh: prefiller.make_packages(next(fresh)), repeats)
        prefill.append({"rows": rows, "longest": n, "seconds": t})

    decode = []
    for batch, span in decode_points:
        tables = contiguous_tables(batch, span + 1, DEFAULT_BLOCK_SIZE)
        cache = runner.make_kv_cache(batch * len(tables[0]), DEFAULT_BLOCK_SIZE)
        for part in cache.parts:
            part.zero_()  # what is attended must not be uninitialized memory (NaN)
        tokens = [int(t) for t in rng.integers(100, 20000, batch)]
        positions = [span - 1] * batch

        def step(cache=cache, tables=tables, tokens=tokens, positions=positions) -> None:
            logits = runner.decode(cache, tables, tokens, positions)
            logits.argmax(dim=-1).tolist()

        step()
        t = _median_time(step, max(repeats, 5))
        decode.append({"batch": batch, "span": span, "seconds": t})
    return {
        "num_threads": num_threads,
        "model": cfg.model,
        "kind": model_dtype(core.model),  # float32+int8dp: int8 panels under float32
        "kv_bytes_per_token": runner.layout.bytes_per_token(),
        "prefill": prefill,
        "decode": decode,
    }


def measure_hop(sizes: Sequence[int] = HOP_SIZES, repeats: int = 5) -> dict[str, Any]:
    """Put a numpy array in one actor, get it in another, on the same node and across nodes
    of a two-node local Ray cluster. Also the round trip of an empty actor call."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 2}, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"node_b": 2})
    try:
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)

        @ray.remote(num_cpus=0)
        class Producer:
            def make(self, nbytes: int) -> list[Any]:
                arr = np.ones(nbytes // 4, dtype=np.float32)
                return [ray.put(arr), time.time()]

            def ping(self) -> float:
                return time.time()

        @ray.remote(num_cpus=0)
        class Consumer:
            def fetch(self, wrapped: list[Any], put_at: float) -> float:
                arr = ray.get(wrapped[0])
                assert arr.nbytes > 0
                return time.time() - put_at

        producer = Producer.options(resources={"node_a": 1}).remote()
        local = Consumer.options(resources={"node_a": 1}).remote()
        remote = Consumer.options(resources={"node_b": 1}).remote()
        ray.get([producer.ping.remote(), local.fetch.remote([ray.put(np.ones(4))], time.time()),
                 remote.fetch.remote([ray.put(np.ones(4))], time.time())])
        rtt = _median_time(lambda: ray.get(producer.ping.remote()), 20)
        points = []
        for where, consumer in (("same_node", local), ("cross_node", remote)):
            for nbytes in sizes:
                times = []
                for _ in range(repeats):
                    ref, put_at = ray.get(producer.make.remote(nbytes))
                    times.append(ray.get(consumer.fetch.remote([ref], put_at)))
                    del ref
                points.append({"where": where, "bytes": nbytes,
                               "seconds": statistics.median(times)})
        return {"actor_call_rtt_s": rtt, "points": points}
    finally:
        ray.shutdown()
        cluster.shutdown()


def fit_hop(points: list[dict[str, Any]], where: str) -> tuple[float, float]:
    """(latency s, bandwidth GB/s) of ``seconds ~ latency + bytes / bandwidth``."""
    pts = [p for p in points if p["where"] == where]
    fit = fit_linear([p["bytes"] for p in pts], [0.0] * len(pts), [p["seconds"] for p in pts])
    gbs = 1e-9 / fit.c1 if fit.c1 > 0 else 1e3
    return max(fit.c0, 0.0), gbs


STACK_CONCURRENCY = (1, 2, 4, 8)
STACK_PROMPTS = (64, 256)
STACK_SEED = 7919


def measure_stack(base_url: str, *, concurrency: Sequence[int] = STACK_CONCURRENCY,
                  prompt_lens: Sequence[int] = STACK_PROMPTS, input_len: int = 64,
                  output_len: int = 48, rounds: int = 2) -> dict[str, Any]:
    """Time the serving stack around the engine: a live app (split or colocated) at
    ``base_url``, driven over HTTP by the load generator.

    * decode: ``b`` closed-loop streams (``input_len`` prompts, ``output_len`` tokens each,
      ``rounds`` requests per stream) for each ``b`` in ``concurrency``: TPOT p50;
    * requests: one request at a time of each prompt length, two output tokens: TTFT p50.
    ``stack_device`` subtracts the engine's own pass times from these.
    """
    import asyncio

    from app.config import DEFAULT_MODEL, EngineConfig
    from app.idle_cores import machine_busy_s
    from app.model_loader import load_tokenizer
    from load_tests.loadgen import LoadPlan, Stream, run_load
    from load_tests.metrics import summarize
    from load_tests.workloads import PromptFactory, RequestClass

    factory = PromptFactory(load_tokenizer(EngineConfig(model=DEFAULT_MODEL)))

    def run(cls_spec: str, clients: int, n: int) -> dict[str, Any]:
        cls = RequestClass.parse(cls_spec)
        # prompts no load run sends (those seed from 0 up): a validation run's first
        # requests would otherwise find this profile's prompts in the prefix cache
        plan = LoadPlan(base_url, "completions", [Stream("s", [cls], n, concurrency=clients)],
                        duration_s=600.0, seed=STACK_SEED)
        res = asyncio.run(run_load(plan, lambda c, rng: factory.make(c, "completions", rng),
                                   progress=False, warmup=1))
        summary = summarize(res.records, res.duration_s)
        if summary["failed"]:
            raise RuntimeError(f"stack profile: requests failed: {summary['errors']}")
        return summary

    decode, stat = [], Path("/proc/stat")
    for b in concurrency:
        # the machine's CPU time over the run (every process: engines, stack, this client),
        # from which ``stack_cores`` takes the engines' own passes
        wall0, busy0 = time.monotonic(), machine_busy_s(stat)
        s = run(f"name=d,input={input_len},output={output_len}", b, rounds * b)
        wall1, busy1 = time.monotonic(), machine_busy_s(stat)
        point = {"batch": b, "span": input_len + output_len // 2,
                 "tpot_s": s["tpot_ms"]["p50"] / 1000.0}
        if busy0 is not None and busy1 is not None:
            # the warm-up request (one, first) is in the window too
            point.update(wall_s=wall1 - wall0, cpu_busy_s=busy1 - busy0,
                         requests=rounds * b + 1, input_len=input_len,
                         output_tokens=s["output_tokens"] + output_len)
        decode.append(point)
    requests = []
    for n in prompt_lens:
        s = run(f"name=p,input={n},output=2", 1, 3)
        requests.append({"prompt_tokens": n, "ttft_s": s["ttft_ms"]["p50"] / 1000.0})
    return {"base_url": base_url, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cores": len(os.sched_getaffinity(0)), "decode": decode, "requests": requests}


def stack_cores(device: DeviceProfile, stack: dict[str, Any]) -> float | None:
    """Cores the serving stack (proxy, ingress, Ray, the client) keeps busy while tokens
    stream, on a machine it shares with the engines, from ``measure_stack``'s decode runs:
    the machine's busy time less the engines' own (each request's prefill pass and its
    tokens' decode steps at the run's batch, from ``device``), over the run's wall time;
    the median over the runs. (Measured on two cores at 1 to 8 streams it stays near 0.6-1.0
    of a core whatever the token rate: much of it is per step or polling, not per token.)
    None when the stack file has no CPU figures (taken before they were recorded)."""
    cores = []
    for p in stack["decode"]:
        if "cpu_busy_s" not in p or not p.get("output_tokens") or not p.get("wall_s"):
            continue
        b, tokens = p["batch"], p["output_tokens"]
        engines = (tokens / b * device.decode_s(b, p["span"])
                   + p["requests"] * device.prefill_s(1, p["input_len"]))
        cores.append(max(0.0, p["cpu_busy_s"] - engines) / p["wall_s"])
    return statistics.median(cores) if cores else None


def stack_device(device: DeviceProfile, stack: dict[str, Any], *,
                 hop: bool = True) -> DeviceProfile:
    """``device`` with the serving stack's costs fitted from ``measure_stack``.

    * Prefill: a lone request's TTFT is ``overhead + factor x (prefill pass + KV hop)``
      (with ``hop``); two prompt lengths give both (the factor is the engine slowed by the
      processes it shares the cores with, the overhead HTTP, routing and tokenizing).
    * Decode: ``decode_stack = c0 + c1 x batch`` is the measured TPOT less the engine's step
      at that batch and span, least squares over the batches (``c0`` may be negative: it also
      corrects the engine fit where the server's step is quicker than the fit says).
    """
    pts = []
    for p in stack["requests"]:
        n = p["prompt_tokens"]
        engine = device.prefill_s(1, n) + (device.hop_s(n * device.kv_bytes_per_token)
                                           if hop else 0.0)
        pts.append((engine, p["ttft_s"]))
    pts.sort()
    (e0, t0), (e1, t1) = pts[0], pts[-1]
    factor = max(1.0, (t1 - t0) / (e1 - e0)) if e1 > e0 else 1.0
    overhead = max(0.0, statistics.median(t - factor * e for e, t in pts))
    dc = stack["decode"]
    x = np.array([[1.0, p["batch"]] for p in dc])
    y = np.array([p["tpot_s"] - device.decode_s(p["batch"], p["span"]) for p in dc])
    (c0, c1), *_ = np.linalg.lstsq(x, y, rcond=None)
    return dataclasses.replace(
        device.slowed_prefill(factor), decode_stack=Linear(float(c0), max(0.0, float(c1)), 0.0),
        request_overhead_s=overhead)


def device_from_measurement(engine: dict[str, Any], hop: dict[str, Any] | None, *,
                            where: str = "same_node", kv_budget_tokens: int = 65536,
                            request_overhead_s: float | None = None) -> DeviceProfile:
    """Fit one replica's profile from measured passes (and hop, when measured)."""
    pf = engine["prefill"]
    prefill = PassCost(0.0, fit_linear([p["rows"] * p["longest"] for p in pf],
                                       [p["rows"] * p["longest"] ** 2 for p in pf],
                                       [p["seconds"] for p in pf]))
    dc = engine["decode"]
    decode = PassCost(0.0, fit_linear([p["batch"] for p in dc],
                                      [p["batch"] * p["span"] for p in dc],
                                      [p["seconds"] for p in dc]))
    latency, gbs = (0.0, 10.0) if hop is None else fit_hop(hop["points"], where)
    if request_overhead_s is None:
        # HTTP proxy -> ingress -> prefill -> ingress -> decode: three Serve calls, each about
        # one actor round trip plus Serve's routing (taken as another)
        request_overhead_s = 0.0 if hop is None else 6 * hop["actor_call_rtt_s"]
    cores = engine["num_threads"]
    return DeviceProfile(
        name=f"cpu-{cores}t",
        prefill=prefill,
        decode=decode,
        kv_bytes_per_token=engine["kv_bytes_per_token"],
        kv_budget_tokens=kv_budget_tokens,
        hop_latency_s=latency,
        hop_gbs=gbs,
        request_overhead_s=request_overhead_s,
        price_per_hour=CPU_PRICE_PER_CORE_HOUR * cores,
        power_prefill_w=CPU_WATTS_BUSY_PER_CORE * cores,
        power_decode_w=CPU_WATTS_BUSY_PER_CORE * cores,
        power_idle_w=CPU_WATTS_IDLE_PER_CORE * cores,
        source=f"measured on {platform.node()} ({platform.processor() or platform.machine()}), "
               f"{cores} torch thread(s), {engine['model']} ({engine.get('kind', '?')}); KV hop "
               f"{where}; power and price "
               "assumed (see planner/profile.py)",
    )


def run_profile(out: Path, *, threads: Sequence[int] = (1, 2), hop: bool = True,
                quick: bool = False, model: str | None = None,
                worker_thread: bool = True, dtype: str = "auto",
                weights: str | None = None) -> dict[str, Any]:
    engines = {str(t): measure_engine(t, quick=quick, model=model, repeats=2 if quick else 3,
                                      worker_thread=worker_thread, dtype=dtype, weights=weights)
               for t in threads}
    hop_data = measure_hop(repeats=3 if quick else 5) if hop else None
    profile = {
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"node": platform.node(), "processor": platform.processor(),
                    "machine": platform.machine()},
        "dtype": dtype,
        "weights": weights,
        "engines": engines,
        "hop": hop_data,
        "devices": {f"cpu-{t}t": device_from_measurement(e, hop_data).to_dict()
                    for t, e in engines.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1))
    return profile


def load_devices(path: str | Path) -> dict[str, DeviceProfile]:
    """The fitted device profiles of a profile file, by name (``cpu-1t``, ``cpu-2t``)."""
    data = json.loads(Path(path).read_text())
    return {name: DeviceProfile.from_dict(d) for name, d in data["devices"].items()}
