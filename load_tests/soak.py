"""Overload for minutes: twice the measured capacity, then back to normal load (issue 16).

Starts the three-node test cluster (``tests.cluster.split_topology``: ingress on the head, one
prefill and one decode node, 120 MB object stores), deploys the split app with its default
engine settings and the load shedding of the cluster manifests (``--max-queue-wait-s``), and
runs four phases of W-short requests (64-token prompts, 64 output tokens,
``/v1/completions``, streamed, greedy, ``ignore_eos``):

1. ``capacity``: a closed loop of ``--concurrency`` streams; its completed requests per second
   is the capacity;
2. ``before``: Poisson arrivals at ``--normal`` x capacity (the baseline latency);
3. ``overload``: Poisson arrivals at ``--overload`` x capacity;
4. ``after``: ``--normal`` x capacity again (recovery without a restart).

Every ``--sample-s`` seconds it records the RSS of every Serve process (replicas, proxy,
controller; from /proc, all on this machine) and the bytes of KV-sized objects in the object
stores. It prints, per phase, requests by outcome (200, each refusal code, stream errors,
client timeouts), how fast refusals came and whether they carried Retry-After, latency of the
admitted requests, and at the end the memory figures and the time the app took to return to
its baseline median TTFT. It takes the test cluster's lock itself (never wrap it in flock).
Bounded: each phase stops issuing at its end and waits at most ``--drain-s`` for its
requests; traffic goes to 127.0.0.1 only.

    .venv/bin/python -m load_tests.soak \\
        --overload-s 180 --out load_tests/results/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from load_tests.client import sse_events

PROMPT_WORDS = 60  # ~64 tokens with the chat model's tokenizer


@dataclass
class Outcome:
    phase: str
    sent_at: float
    status: int | None = None  # HTTP status; None: no response (client timeout, reset)
    ok: bool = False  # 200 and a complete stream
    stream_error: str | None = None
    retry_after: str | None = None
    answered_s: float | None = None  # time to the status line (a refusal's speed)
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0


@dataclass
class Sample:
    at: float
    rss_mb: dict[str, float] = field(default_factory=dict)
    kv_object_mb: float = 0.0
    prefix_cache_mb: float = 0.0  # the prefill replica's prefix cache (fills to its budget)


def prompt(i: int) -> str:
    rng = random.Random(i)
    words = ["river", "stone", "light", "cloud", "paper", "green", "north", "quiet", "metal",
             "glass", "field", "story"]
    return " ".join(rng.choice(words) for _ in range(PROMPT_WORDS))


async def one(client: httpx.AsyncClient, url: str, phase: str, i: int, t0: float,
              max_tokens: int, timeout_s: float) -> Outcome:
    sent = time.perf_counter()
    out = Outcome(phase, sent - t0)
    try:
        await asyncio.wait_for(_stream(client, url, i, max_tokens, sent, out), timeout_s)
    except (asyncio.TimeoutError, httpx.HTTPError) as exc:
        out.stream_error = type(exc).__name__
        return out
    if out.status == 200 and out.stream_error is None:
        out.e2e_s = time.perf_counter() - sent
        out.ok = out.tokens == max_tokens
        if not out.ok:
            out.stream_error = f"short stream: {out.tokens} tokens"
    return out


async def _stream(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, sent: float,
                  out: Outcome) -> None:
    body = {"prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        out.status = resp.status_code
        out.answered_s = time.perf_counter() - sent
        out.retry_after = resp.headers.get("retry-after")
        if resp.status_code != 200:
            await resp.aread()
            return
        async for chunk in sse_events(resp):
            if "error" in chunk:
                out.stream_error = str(chunk["error"].get("type"))
                return
            if chunk.get("usage"):
                out.tokens = chunk["usage"]["completion_tokens"]
            elif out.ttft_s is None and chunk["choices"][0].get("text"):
                out.ttft_s = time.perf_counter() - sent


async def closed_loop(client, url, phase, t0, concurrency, seconds, max_tokens, timeout_s,
                      counter) -> list[Outcome]:
    end = time.perf_counter() + seconds
    results: list[Outcome] = []

    async def worker() -> None:
        while time.perf_counter() < end:
            counter[0] += 1
            results.append(await one(client, url, phase, counter[0], t0, max_tokens, timeout_s))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def open_loop(client, url, phase, t0, rate, seconds, max_tokens, timeout_s, drain_s,
                    counter, seed) -> list[Outcome]:
    rng = random.Random(seed)
    end = time.perf_counter() + seconds
    tasks: list[asyncio.Task] = []
    while True:
        await asyncio.sleep(rng.expovariate(rate))
        if time.perf_counter() >= end:
            break
        counter[0] += 1
        tasks.append(asyncio.create_task(
            one(client, url, phase, counter[0], t0, max_tokens, timeout_s)))
    done, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    results = [t.result() for t in done]
    results += [Outcome(phase, -1.0, stream_error="hung: not finished within the drain")
                for _ in pending]
    return results


def serve_processes() -> dict[str, int]:
    """pid of every live Serve actor, by a short name (deployment, proxy, controller)."""
    from ray.util.state import list_actors

    out: dict[str, int] = {}
    for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000, detail=True):
        name = a.class_name.split(":")[-1] if a.class_name.startswith("ServeReplica") \
            else a.class_name
        if a.pid and (a.class_name.startswith("ServeReplica") or "Proxy" in a.class_name
                      or "Controller" in a.class_name):
            key, k = name, 1
            while key in out:
                k += 1
                key = f"{name}#{k}"
            out[key] = a.pid
    return out


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def kv_object_mb() -> float:
    from ray.util.state import list_objects

    objects = list_objects(limit=10000, raise_on_missing_output=False)
    sizes = {o.object_id: o.object_size for o in objects if (o.object_size or 0) >= 1 << 20}
    return sum(sizes.values()) / 1e6


def prefix_cache_mb(app: str) -> float:
    from ray import serve

    stats = serve.get_deployment_handle("PrefillServer", app).stats.remote().result(
        timeout_s=30)
    return float(stats.get("prefix_cache_bytes", 0)) / 1e6


def sampler(stop: threading.Event, samples: list[Sample], t0: float, every_s: float,
            app: str) -> None:
    pids: dict[str, int] = {}
    while not stop.is_set():
        try:
            pids = serve_processes() or pids
            rss = {name: m for name, pid in pids.items() if (m := rss_mb(pid)) is not None}
            samples.append(Sample(time.perf_counter() - t0, rss, kv_object_mb(),
                                  prefix_cache_mb(app)))
        except Exception as exc:  # a sampling hiccup must not end the soak
            print(f"sample failed: {exc!r}")
        stop.wait(every_s)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def phase_summary(results: list[Outcome]) -> dict[str, Any]:
    codes: dict[str, int] = {}
    for r in results:
        key = str(r.status) if r.status is not None else "no response"
        if r.status == 200 and not r.ok:
            key = f"200 + {r.stream_error}"
        codes[key] = codes.get(key, 0) + 1
    refused = [r for r in results if r.status in (429, 503)]
    ok = [r for r in results if r.ok]
    ms = lambda v: None if v is None else round(v * 1000)  # noqa: E731
    return {
        "sent": len(results),
        "by_outcome": codes,
        "refused_answered_p99_ms": ms(pct([r.answered_s for r in refused], 99)),
        "refused_with_retry_after": sum(r.retry_after is not None for r in refused),
        "ok_ttft_p50_ms": ms(pct([r.ttft_s for r in ok if r.ttft_s], 50)),
        "ok_ttft_p99_ms": ms(pct([r.ttft_s for r in ok if r.ttft_s], 99)),
        "ok_e2e_p50_ms": ms(pct([r.e2e_s for r in ok], 50)),
        "ok_e2e_p99_ms": ms(pct([r.e2e_s for r in ok], 99)),
        "server_errors_5xx_not_503": sum(1 for r in results
                                         if r.status and r.status >= 500 and r.status != 503),
        "hung": sum(1 for r in results if r.stream_error and r.stream_error.startswith("hung")),
    }


def recovery_s(after: list[Outcome], baseline_p50: float, after_start: float,
               window: int = 5) -> float | None:
    """Seconds from the end of the overload until the first of ``window`` admitted requests
    in a row whose TTFTs are all within 1.2x the baseline median (None: never)."""
    ok = sorted((r for r in after if r.ok and r.ttft_s), key=lambda r: r.sent_at)
    for i in range(len(ok) - window + 1):
        chunk = ok[i:i + window]
        if all(r.ttft_s <= 1.2 * baseline_p50 for r in chunk):
            return max(0.0, chunk[0].sent_at - after_start)
    return None


def memory_summary(samples: list[Sample], warm_until: float) -> dict[str, Any]:
    warm = [s for s in samples if s.at >= warm_until]
    if not warm:
        return {}
    names = sorted({n for s in warm for n in s.rss_mb})
    per_process = {}
    for name in names:
        series = [s.rss_mb[name] for s in warm if name in s.rss_mb]
        per_process[name] = {"after_warmup_mb": round(series[0]), "peak_mb": round(max(series)),
                             "end_mb": round(series[-1]),
                             "growth_pct": round(100 * (series[-1] / series[0] - 1), 1)}
    first, last = warm[0], warm[-1]
    prefill = per_process.get("PrefillServer")
    if prefill is not None and "PrefillServer" in first.rss_mb:
        # the prefix cache fills to its budget by design: the rest is what must stay flat
        less = (last.rss_mb["PrefillServer"] - last.prefix_cache_mb) / \
            (first.rss_mb["PrefillServer"] - first.prefix_cache_mb)
        prefill["growth_less_prefix_cache_pct"] = round(100 * (less - 1), 1)
    return {"rss": per_process,
            "prefix_cache_mb": {"after_warmup": round(first.prefix_cache_mb),
                                "end": round(last.prefix_cache_mb)},
            "kv_objects_peak_mb": round(max(s.kv_object_mb for s in samples), 1),
            "kv_objects_end_mb": round(samples[-1].kv_object_mb, 1)}


async def run_phases(args: argparse.Namespace, url: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    counter = [0]
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        t0 = time.perf_counter()
        common = {"max_tokens": args.max_tokens, "timeout_s": args.client_timeout_s}
        cap = await closed_loop(client, url, "capacity", t0, args.concurrency, args.capacity_s,
                                counter=counter, **common)
        done = [r for r in cap if r.ok]
        capacity = len(done) / args.capacity_s
        print(f"capacity: {capacity:.2f} req/s ({len(done)} in {args.capacity_s:g} s, "
              f"{args.concurrency} streams)", flush=True)
        phases = {"capacity": cap}
        starts = {}
        for name, factor, seconds in (("before", args.normal, args.normal_s),
                                      ("overload", args.overload, args.overload_s),
                                      ("after", args.normal, args.after_s)):
            starts[name] = time.perf_counter() - t0
            rate = factor * capacity
            print(f"{name}: {rate:.2f} req/s for {seconds:g} s", flush=True)
            phases[name] = await open_loop(client, url, name, t0, rate, seconds,
                                           drain_s=args.drain_s, counter=counter,
                                           seed=hash(name) & 0xFFFF, **common)
        return {"capacity_rps": capacity, "phases": phases, "starts": starts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--capacity-s", type=float, default=60)
    p.add_argument("--normal", type=float, default=0.5, help="normal load, x capacity")
    p.add_argument("--normal-s", type=float, default=60)
    p.add_argument("--overload", type=float, default=2.0, help="overload, x capacity")
    p.add_argument("--overload-s", type=float, default=180)
    p.add_argument("--after-s", type=float, default=90)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--drain-s", type=float, default=300)
    p.add_argument("--client-timeout-s", type=float, default=600)
    p.add_argument("--sample-s", type=float, default=5)
    p.add_argument("--max-queue-wait-s", type=float, default=30.0,
                   help="the ingress's load shedding (ingress.max_queue_wait_s, as the "
                   "cluster manifests set it); 0: off")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from ray import serve

    from deployments.builder import build_app
    from tests.cluster import phase_args, split_topology, wait_ready

    with split_topology() as topo:
        wait = args.max_queue_wait_s or None
        serve.run(build_app(phase_args(ingress={"max_queue_wait_s": wait})), name="soak",
                  route_prefix="/", blocking=False)
        wait_ready(topo.url)
        samples: list[Sample] = []
        stop = threading.Event()
        t0 = time.perf_counter()
        thread = threading.Thread(target=sampler,
                                  args=(stop, samples, t0, args.sample_s, "soak"))
        thread.start()
        try:
            run = asyncio.run(run_phases(args, topo.url))
        finally:
            time.sleep(2 * args.sample_s)  # what is left once every request has ended
            stop.set()
            thread.join(60)
    phases = run["phases"]
    summary = {name: phase_summary(results) for name, results in phases.items()}
    base = pct([r.ttft_s for r in phases["before"] if r.ok and r.ttft_s], 50)
    after_start = run["starts"]["after"]
    report = {
        "capacity_rps": round(run["capacity_rps"], 3),
        "phases": summary,
        "recovery_s": None if base is None else recovery_s(phases["after"], base, after_start),
        "memory": memory_summary(samples, warm_until=run["starts"]["before"]),
    }
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**report, "args": vars(args) | {"out": str(args.out)},
                                        "samples": [asdict(s) for s in samples]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
