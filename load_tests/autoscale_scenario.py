"""Autoscaling scenario: the workload shifts prefill-heavy -> decode-heavy -> prefill-heavy and
each phase's replica count follows its own load.

    python -m load_tests.autoscale_scenario [--phase-s 50] [--json out.json] [--png out.png]

Builds the test topology on this machine (a head for the ingress, a node offering
`prefill_accel: 2`, one offering `decode_accel: 2`), deploys the split app with both phases
autoscaling on their own policies (1..2 replicas, short delays) and drives it over HTTP on
127.0.0.1 through a schedule of workload phases:

    warm-up (idle) | prefill-heavy | decode-heavy | prefill-heavy | cool-down (idle)

* prefill-heavy: `--prefill-clients` closed-loop clients, 1024-token prompts, 2 output tokens;
* decode-heavy: `--decode-clients` closed-loop clients, 32-token prompts, 64 output tokens.

Every 0.5 s it samples the running replicas of each phase (`serve.status()`). From the
requests (each timed by `load_tests.client.send_streaming`) it rebuilds each phase's queue as
a client sees it: prompt tokens sent and not yet answered by a first token (waiting for
prefill), and streams between their first and last token (decoding); and the TTFT / TPOT of
the requests finishing around each moment (TTFT of the long prompts, TPOT of the long
outputs: each phase's own latency). Writes the timeline as JSON and draws it (replicas,
queues, latency vs time, workload phases shaded) as a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from load_tests.client import send_streaming
from load_tests.metrics import RequestRecord
from tests.cluster import phase_args, split_topology, wait_ready

APP = "autoscale-scenario"
SAMPLE_S = 0.5
LATENCY_WINDOW_S = 5.0
PREFILL_PROMPT, PREFILL_OUTPUT = 1024, 2
DECODE_PROMPT, DECODE_OUTPUT = 32, 64


@dataclass(frozen=True)
class Phase:
    name: str  # "idle", "prefill-heavy", "decode-heavy"
    start_s: float
    end_s: float


def schedule(phase_s: float, idle_s: float) -> list[Phase]:
    names = ["idle", "prefill-heavy", "decode-heavy", "prefill-heavy", "idle"]
    lengths = [idle_s / 2, phase_s, phase_s, phase_s, idle_s]
    phases, t = [], 0.0
    for name, length in zip(names, lengths, strict=True):
        phases.append(Phase(name, t, t + length))
        t += length
    return phases


def scenario_args(decode_sequences: int) -> dict:
    autoscaling = {
        "min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
        "upscale_delay_s": 2.0, "downscale_delay_s": 8.0, "look_back_period_s": 3.0,
        "metrics_interval_s": 0.5,
    }
    return phase_args(
        prefill={"deployment_config": {"autoscaling_config": autoscaling},
                 "scaling": {"target_queue_delay_s": 0.5}},
        decode={"deployment_config": {"autoscaling_config": autoscaling},
                "scaling": {"sequences_per_replica": decode_sequences}},
    )


def prompt_ids(n: int, salt: int) -> list[int]:
    return [1000 + (salt * 7919 + i * 31) % 20000 for i in range(n)]


class ReplicaSampler(threading.Thread):
    """Samples the running replicas of each phase every SAMPLE_S seconds."""

    def __init__(self, run_start: float) -> None:
        super().__init__(daemon=True)
        self.run_start = run_start
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        from ray import serve

        while not self.stop.is_set():
            try:
                deps = serve.status().applications[APP].deployments
                counts = [int(deps[n].replica_states.get("RUNNING", 0))
                          for n in ("PrefillServer", "DecodeServer")]
                self.samples.append((time.perf_counter() - self.run_start, *counts))
            except Exception:
                pass
            self.stop.wait(SAMPLE_S)


async def drive(url: str, phases: list[Phase], run_start: float, prefill_clients: int,
                decode_clients: int) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    end = phases[-1].end_s
    endpoint = f"{url}/v1/completions"

    def phase_at(t: float) -> str:
        return next((p.name for p in phases if p.start_s <= t < p.end_s), "idle")

    async def client_loop(kind: str, i: int, client: httpx.AsyncClient) -> None:
        n = 0
        while (t := time.perf_counter() - run_start) < end:
            if phase_at(t) != kind:
                await asyncio.sleep(0.1)
                continue
            n += 1
            prompt, out = ((PREFILL_PROMPT, PREFILL_OUTPUT) if kind == "prefill-heavy"
                           else (DECODE_PROMPT, DECODE_OUTPUT))
            body = {"prompt": prompt_ids(prompt, i * 100_000 + n), "max_tokens": out,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            records.append(await send_streaming(client, endpoint, body, "completions", kind,
                                                run_start, prompt_tokens=prompt))

    limits = httpx.Limits(max_connections=prefill_clients + decode_clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(
            *(client_loop("prefill-heavy", i, client) for i in range(prefill_clients)),
            *(client_loop("decode-heavy", 1000 + i, client) for i in range(decode_clients)))
    return records


def timeline(records: list[RequestRecord], samples: list[tuple[float, int, int]],
             end_s: float) -> list[dict]:
    """One row per SAMPLE_S: replicas, client-side queues and recent latencies."""
    ok = [r for r in records if r.ok and r.ttft_s is not None and r.e2e_s is not None]
    rows = []
    t = 0.0
    while t <= end_s:
        before = [s for s in samples if s[0] <= t]
        _, prefill, decode = before[-1] if before else (t, 0, 0)
        waiting_tokens = sum(r.prompt_tokens or 0 for r in records
                             if r.sent_at <= t and (r.ttft_s is None
                                                    or t < r.sent_at + r.ttft_s))
        decoding = sum(1 for r in ok if r.sent_at + r.ttft_s <= t < r.sent_at + r.e2e_s
                       and r.output_tokens > 1)
        # TTFT of the long prompts (prefill's latency), TPOT of the long outputs (decode's)
        recent_first = [r.ttft_s for r in ok if r.request_class == "prefill-heavy"
                        and t - LATENCY_WINDOW_S < r.sent_at + r.ttft_s <= t]
        recent_done = [r.tpot_s for r in ok if r.request_class == "decode-heavy"
                       and r.tpot_s is not None
                       and t - LATENCY_WINDOW_S < r.sent_at + r.e2e_s <= t]
        rows.append({
            "t_s": round(t, 2), "prefill_replicas": prefill, "decode_replicas": decode,
            "prefill_waiting_tokens": waiting_tokens, "decode_streams": decoding,
            "ttft_p50_s": statistics.median(recent_first) if recent_first else None,
            "tpot_p50_s": statistics.median(recent_done) if recent_done else None,
        })
        t += SAMPLE_S
    return rows


def summarize(rows: list[dict], phases: list[Phase], records: list[RequestRecord]) -> dict:
    """Per workload phase: replicas reached, when they were reached, latency."""
    out = {"phases": [], "requests": len(records),
           "errors": sum(1 for r in records if not r.ok)}
    for p in phases:
        inside = [r for r in rows if p.start_s <= r["t_s"] < p.end_s]
        if not inside:
            continue

        def first_at(key: str, value: int, inside: list[dict] = inside,
                     p: Phase = p) -> float | None:
            hit = next((r["t_s"] for r in inside if r[key] == value), None)
            return None if hit is None else round(hit - p.start_s, 1)

        reqs = [r for r in records if r.ok and p.start_s <= r.sent_at < p.end_s]
        ttfts = [r.ttft_s for r in reqs if r.ttft_s is not None
                 and r.request_class == "prefill-heavy"]
        tpots = [r.tpot_s for r in reqs if r.tpot_s is not None
                 and r.request_class == "decode-heavy"]
        out["phases"].append({
            "phase": p.name, "start_s": p.start_s, "end_s": p.end_s,
            "prefill_replicas_max": max(r["prefill_replicas"] for r in inside),
            "decode_replicas_max": max(r["decode_replicas"] for r in inside),
            "prefill_replicas_end": inside[-1]["prefill_replicas"],
            "decode_replicas_end": inside[-1]["decode_replicas"],
            "prefill_at_2_after_s": first_at("prefill_replicas", 2),
            "decode_at_2_after_s": first_at("decode_replicas", 2),
            "prefill_at_1_after_s": first_at("prefill_replicas", 1),
            "decode_at_1_after_s": first_at("decode_replicas", 1),
            "requests": len(reqs),
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "tpot_p50_s": statistics.median(tpots) if tpots else None,
        })
    return out


def plot(rows: list[dict], phases: list[Phase], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] for r in rows]
    fig, (ax_rep, ax_q, ax_lat) = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True,
                                               gridspec_kw={"height_ratios": [1.1, 1, 1]})
    colors = {"prefill-heavy": "#c6dbef", "decode-heavy": "#fdd0a2", "idle": "#f0f0f0"}
    for ax in (ax_rep, ax_q, ax_lat):
        for p in phases:
            ax.axvspan(p.start_s, p.end_s, color=colors[p.name], alpha=0.6, lw=0)
    for p in phases:
        ax_rep.text((p.start_s + p.end_s) / 2, 2.45, p.name, ha="center", va="center",
                    fontsize=9)
    ax_rep.step(t, [r["prefill_replicas"] for r in rows], where="post", color="tab:blue",
                lw=2.2, label="prefill replicas")
    ax_rep.step(t, [r["decode_replicas"] + 0.04 for r in rows], where="post",
                color="tab:orange", lw=2.2, label="decode replicas")
    ax_rep.set_ylim(0.5, 2.7)
    ax_rep.set_yticks([1, 2])
    ax_rep.set_ylabel("running replicas")
    ax_rep.legend(loc="lower right", fontsize=8)
    ax_rep.set_title(title, fontsize=10)

    ax_q.plot(t, [r["prefill_waiting_tokens"] for r in rows], color="tab:blue",
              label="prompt tokens waiting for first token")
    ax_q.set_ylabel("prefill queue (tokens)", color="tab:blue")
    ax_q2 = ax_q.twinx()
    ax_q2.plot(t, [r["decode_streams"] for r in rows], color="tab:orange",
               label="streams decoding")
    ax_q2.set_ylabel("decode streams", color="tab:orange")
    lines = ax_q.get_legend_handles_labels()[0] + ax_q2.get_legend_handles_labels()[0]
    ax_q.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)

    ttft = [(r["t_s"], r["ttft_p50_s"]) for r in rows if r["ttft_p50_s"] is not None]
    tpot = [(r["t_s"], r["tpot_p50_s"] * 1000) for r in rows if r["tpot_p50_s"] is not None]
    if ttft:
        ax_lat.plot(*zip(*ttft, strict=True), ".", ms=3, color="tab:blue",
                    label=f"TTFT p50, long prompts (last {LATENCY_WINDOW_S:.0f} s)")
    ax_lat.set_ylabel("TTFT (s)", color="tab:blue")
    ax_lat2 = ax_lat.twinx()
    if tpot:
        ax_lat2.plot(*zip(*tpot, strict=True), ".", ms=3, color="tab:orange",
                     label=f"TPOT p50, long outputs (last {LATENCY_WINDOW_S:.0f} s)")
    ax_lat2.set_ylabel("TPOT (ms)", color="tab:orange")
    lines = ax_lat.get_legend_handles_labels()[0] + ax_lat2.get_legend_handles_labels()[0]
    ax_lat.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
    ax_lat.set_xlabel("time (s)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _run_scenario(phases: list[Phase], decode_sequences: int, prefill_clients: int,
                  decode_clients: int) -> tuple[list[RequestRecord], list[tuple[float, int, int]]]:
    """The cluster and the autoscaling app, driven through the schedule while the replicas are
    sampled; the requests' records and the replica samples."""
    from ray import serve

    from deployments.builder import build_app

    with split_topology(prefill_slots=2, decode_slots=2) as topo:
        url = f"{topo.url}/{APP}"
        serve.run(build_app(scenario_args(decode_sequences)), name=APP,
                  route_prefix=f"/{APP}", blocking=False)
        wait_ready(url)
        run_start = time.perf_counter()
        sampler = ReplicaSampler(run_start)
        sampler.start()
        records = asyncio.run(drive(url, phases, run_start, prefill_clients, decode_clients))
        sampler.stop.set()
        sampler.join(timeout=10)
    return records, sampler.samples


def _print_summary(summary: dict) -> None:
    for p in summary["phases"]:
        print(f"{p['phase']:>14} {p['start_s']:6.0f}-{p['end_s']:<6.0f} "
              f"prefill max {p['prefill_replicas_max']} (2 after {p['prefill_at_2_after_s']} s,"
              f" end {p['prefill_replicas_end']})  decode max {p['decode_replicas_max']} "
              f"(2 after {p['decode_at_2_after_s']} s, end {p['decode_replicas_end']})  "
              f"{p['requests']} req  long-prompt TTFT p50 {_ms(p['ttft_p50_s'])}  "
              f"long-output TPOT p50 {_ms(p['tpot_p50_s'])}")
    print(f"{summary['requests']} requests, {summary['errors']} errors")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-s", type=float, default=50.0,
                        help="length of each loaded workload phase")
    parser.add_argument("--idle-s", type=float, default=30.0, help="cool-down (warm-up: half)")
    parser.add_argument("--prefill-clients", type=int, default=3)
    parser.add_argument("--decode-clients", type=int, default=12)
    parser.add_argument("--decode-sequences", type=int, default=4,
                        help="decode policy: sequences one replica should run")
    parser.add_argument("--json", default="load_tests/results/autoscale_scenario.json")
    parser.add_argument("--png", default="docs/benchmarks/issue4-autoscale-scenario.png")
    args = parser.parse_args(argv)

    phases = schedule(args.phase_s, args.idle_s)
    records, samples = _run_scenario(phases, args.decode_sequences, args.prefill_clients,
                                     args.decode_clients)
    end_s = max(phases[-1].end_s, max((r.finished_at or 0.0) for r in records))
    rows = timeline(records, samples, end_s)
    summary = summarize(rows, phases, records)
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "png")}
    _print_summary(summary)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"summary": summary, "timeline": rows,
                   "phases": [vars(p) for p in phases],
                   "requests": [r.as_dict() for r in records]}, fh, indent=1)
    plot(rows, phases, Path(args.png),
         f"Per-phase autoscaling: {args.prefill_clients} clients x {PREFILL_PROMPT}-token "
         f"prompts (prefill-heavy), {args.decode_clients} clients x {DECODE_OUTPUT}-token "
         "outputs (decode-heavy)")
    print(f"wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
