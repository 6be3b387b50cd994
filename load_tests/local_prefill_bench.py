"""Where the KV hop stops paying: prefill a prompt on the decode replica itself, or send it
to the prefill deployment?

    python -m load_tests.local_prefill_bench [--lengths 4,8,16,24,32,48,64,128,256] [--reps 7]
                                             [--streams 4] [--json out.json]

Builds the test topology (head: ingress; a node with only `prefill_accel`, one with only
`decode_accel`) and deploys the split app twice side by side: "hop" (every prompt goes to the
prefill deployment: `local_prefill_threshold: 0`) and "local" (every prompt is prefilled on
the decode replica). For each prompt length L, through HTTP streaming:

1. hop cost h(L): TTFT through "hop" minus TTFT through "local" with nothing else running
   (the extra Serve call, the object-store put and the cross-node pull of the KV package);
2. stall s(L): with `--streams` long streams running on the app's decode replica, the
   longest gap between two tokens of those streams while the new prompt is prefilled, minus
   their median gap; measured for both apps, s(L) = stall(local) - stall(hop) is what a local
   prefill costs every running stream beyond what the hop costs it (on this machine both
   "nodes" share two cores, so the hop path stalls the decode a little too).

A prompt shorter than N is better prefilled locally while the stall it puts on each running
stream stays under what the hop would add to its own TTFT: the recommended default is the
largest measured L with s(L) <= h(L) (the first L past it is where the hop starts paying).
Requests go only to 127.0.0.1, a bounded number of them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from load_tests.client import sse_events
from tests.cluster import phase_args, split_topology, wait_ready

APPS = {"hop": 0, "local": 1_000_000}  # app name -> local_prefill_threshold


@dataclass
class Stream:
    sent: float
    chunk_times: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.sent


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                 out: Stream | None = None) -> Stream:
    """One streaming completion, keeping the arrival time of every chunk."""
    rec = out or Stream(time.perf_counter())
    rec.sent = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for _ in sse_events(r):
            rec.chunk_times.append(time.perf_counter())
    return rec


def prompt_ids(n: int, salt: int) -> list[int]:
    return [1000 + (salt * 7919 + i * 31) % 20000 for i in range(n)]


def max_gap_within(streams: list[Stream], start: float, end: float) -> float | None:
    """Longest gap between consecutive tokens of any stream that overlaps [start, end]."""
    gaps = [b - a for s in streams for a, b in zip(s.chunk_times, s.chunk_times[1:],
                                                        strict=False)
            if b >= start and a <= end]
    return max(gaps) if gaps else None


async def _idle_ttfts(client: httpx.AsyncClient, url_of: dict[str, str], lengths: list[int],
                      reps: int, salts: Iterator[int]) -> dict[str, dict[int, float]]:
    """Median TTFT per app and prompt length with nothing else running, the apps
    interleaved."""
    out: dict[str, dict[int, float]] = {}
    for n in lengths:
        ttft: dict[str, list[float]] = {app: [] for app in url_of}
        for _ in range(reps):
            for app, url in url_of.items():
                ttft[app].append((await stream(client, url, prompt_ids(n, next(salts)),
                                               1)).ttft_s)
        for app in url_of:
            out.setdefault(app, {})[n] = statistics.median(ttft[app])
    return out


async def _stalls(client: httpx.AsyncClient, app: str, url: str, lengths: list[int], reps: int,
                  n_streams: int, salts: Iterator[int], out: dict) -> None:
    """The stall a new prompt's prefill puts on ``n_streams`` running streams of one app;
    fills ``out``'s median_gap_s, stall_s and busy_ttft_s for that app."""
    background: list[Stream] = []
    stop = asyncio.Event()

    async def keep_streaming(i: int) -> None:
        while not stop.is_set():
            rec = Stream(time.perf_counter())
            background.append(rec)
            await stream(client, url, prompt_ids(16, 10**6 + i), 400, rec)

    tasks = [asyncio.create_task(keep_streaming(i)) for i in range(n_streams)]
    await asyncio.sleep(3.0)  # the streams are running
    t_quiet = time.perf_counter()
    await asyncio.sleep(2.0)
    quiet = [b - a for s in background for a, b in
             zip(s.chunk_times, s.chunk_times[1:], strict=False) if a >= t_quiet]
    median_gap = statistics.median(quiet)
    out["median_gap_s"][app] = median_gap
    for n in lengths:
        stalls, ttfts = [], []
        for _ in range(reps):
            probe = await stream(client, url, prompt_ids(n, next(salts)), 1)
            # the token that ends a stall arrives after the probe's first token
            await asyncio.sleep(max(0.5, 4 * median_gap))
            gap = max_gap_within(background, probe.sent, probe.chunk_times[0])
            stalls.append(max(0.0, (gap or median_gap) - median_gap))
            ttfts.append(probe.ttft_s)
        out["stall_s"].setdefault(app, {})[n] = statistics.median(stalls)
        out["busy_ttft_s"].setdefault(app, {})[n] = statistics.median(ttfts)
    stop.set()
    await asyncio.gather(*tasks)


async def measure(url_of: dict[str, str], lengths: list[int], reps: int,
                  n_streams: int) -> dict:
    salts = itertools.count(1)  # every request its own prompt
    out: dict = {"idle_ttft_s": {}, "busy_ttft_s": {}, "stall_s": {}, "median_gap_s": {}}
    async with httpx.AsyncClient(timeout=300) as client:
        for url in url_of.values():  # warm up both paths
            for n in (8, lengths[-1]):
                await stream(client, url, prompt_ids(n, next(salts)), 2)
        # 1. idle TTFT, the two apps interleaved
        out["idle_ttft_s"] = await _idle_ttfts(client, url_of, lengths, reps, salts)
        # 2. the stall a new prompt's prefill puts on running streams, app by app
        for app, url in url_of.items():
            await _stalls(client, app, url, lengths, reps, n_streams, salts, out)
    return out


def recommend(results: dict, lengths: list[int]) -> tuple[int, dict]:
    """The threshold N (prompts shorter than N are prefilled locally): the first measured
    length whose net local stall exceeds the hop's cost; the longest length if none does."""
    rows = {}
    for n in lengths:
        hop_cost = results["idle_ttft_s"]["hop"][n] - results["idle_ttft_s"]["local"][n]
        stall = results["stall_s"]["local"][n] - results["stall_s"]["hop"][n]
        rows[n] = {"hop_cost_ms": hop_cost * 1000, "local_stall_ms": stall * 1000}
    first_paying = next((n for n in lengths
                         if rows[n]["local_stall_ms"] > rows[n]["hop_cost_ms"]), lengths[-1])
    return first_paying, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4,8,16,24,32,48,64,128,256")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))

    from ray import serve

    from deployments.builder import build_app

    with split_topology(prefill_slots=2, decode_slots=2) as topo:
        url_of = {}
        for app, threshold in APPS.items():
            serve.run(build_app(phase_args(local_prefill_threshold=threshold,
                                           local_prefill_when_busy=0)), name=app,
                      route_prefix=f"/{app}", blocking=False)
            url_of[app] = f"{topo.url}/{app}"
        for url in url_of.values():
            wait_ready(url)
        results = asyncio.run(measure(url_of, lengths, args.reps, args.streams))

    threshold, rows = recommend(results, lengths)
    print(f"\nLocal prefill on the decode replica vs the KV hop ({args.reps} reps, "
          f"{args.streams} running streams for the stall)")
    print(f"{'prompt':>7} {'TTFT hop':>9} {'TTFT local':>11} {'hop cost':>9} "
          f"{'stall local':>12} {'stall hop':>10} {'net stall':>10}")
    for n in lengths:
        i = results["idle_ttft_s"]
        s = results["stall_s"]
        print(f"{n:>7} {i['hop'][n] * 1000:>8.1f}m {i['local'][n] * 1000:>10.1f}m "
              f"{rows[n]['hop_cost_ms']:>8.1f}m {s['local'][n] * 1000:>11.1f}m "
              f"{s['hop'][n] * 1000:>9.1f}m {rows[n]['local_stall_ms']:>9.1f}m")
    print(f"median gap between tokens with {args.streams} streams: "
          + ", ".join(f"{app} {g * 1000:.1f} ms" for app, g in results["median_gap_s"].items()))
    print(f"recommended local_prefill_threshold: {threshold} (prompts shorter than this are "
          "prefilled on the decode replica)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"lengths": lengths, "reps": args.reps, "streams": args.streams,
                       "results": results, "rows": rows, "recommended": threshold}, fh,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
