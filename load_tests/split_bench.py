"""The full split path on a three-node Ray cluster vs the engine alone, side by side.

    python -m load_tests.split_bench [--rounds 5] [--json out.json]

Builds the test topology (`tests.cluster`: head for the ingress; one node offering only
`prefill_accel`; one only `decode_accel`; each with its own object store), deploys the app
with one torch thread per phase, and in the same process runs the engine alone with one
thread. Rounds alternate between the two so machine noise hits both alike. Prints:

1. time per output token at concurrency 1 through HTTP streaming vs the engine's decode step
   (target: at most 1.15x);
2. TTFT of a 1024-token prompt split into prefill compute, KV hop and the rest (queueing,
   first-token delivery) (target: KV hop at most 15% of TTFT);
3. KV bytes moved per request vs the package size (target: equal, no extra copies).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from load_tests.client import iter_sse_events


def _stream_request(url: str, prompt_ids: list[int], max_tokens: int) -> dict[str, float]:
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for _ in iter_sse_events(r):
            times.append(time.perf_counter())
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / max(1, len(times) - 1)
    return {"ttft_s": ttft, "tpot_s": tpot, "chunks": len(times)}


def _engine_step_s(core, prompt_ids: list[int], steps: int) -> float:
    """Median decode step at batch 1 (the engine alone, same thread count as a replica)."""
    from app.decode import Decoder
    from app.messages import PrefillRequest
    from app.sampling import SamplingParams
    from app.sequence import Sequence

    [pkg] = core.make_prefiller().make_packages(
        [PrefillRequest("e", tuple(prompt_ids), SamplingParams(max_tokens=steps + 1,
                                                               temperature=0.0,
                                                               ignore_eos=True))])
    dec = Decoder(core.runner, eos_token_ids=frozenset(), max_batch_size=1,
                  max_kv_tokens=65536)
    seq = Sequence("e", pkg.prompt_ids, pkg.sampling)
    seq.append(pkg.first_token, eos_token_ids=frozenset(), max_model_len=8192)
    dec.add(seq, pkg)
    times = []
    while dec.has_work:
        t = time.perf_counter()
        dec.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


SHORT = list(range(1000, 1064))  # 64-token prompt
LONG = list(range(1000, 2024))  # 1024-token prompt


def _measure_rounds(url: str, core, handle, rounds: int,
                    decode_tokens: int) -> tuple[list[float], list[float], list[dict]]:
    """Warm both paths up, then per round: the HTTP TPOT, the engine's decode step and the
    app's trace of one 1024-token prompt."""
    _stream_request(url, SHORT, 4)  # warm up both paths
    _engine_step_s(core, SHORT, 4)
    http_tpot, engine_step, traces = [], [], []
    for _ in range(rounds):
        http_tpot.append(_stream_request(url, SHORT, decode_tokens)["tpot_s"])
        engine_step.append(_engine_step_s(core, SHORT, decode_tokens))
        traces.append(handle.trace.remote(
            {"prompt": LONG, "max_tokens": 1, "temperature": 0}, "completion"
        ).result(timeout_s=300))
    return http_tpot, engine_step, traces


def _summarize(topo, http_tpot: list[float], engine_step: list[float], traces: list[dict],
               rounds: int) -> dict:
    tpot = statistics.median(http_tpot)
    step = statistics.median(engine_step)
    ttft = statistics.median(t["ttft_s"] for t in traces)
    prefill = statistics.median(t["prefill_compute_s"] for t in traces)
    hop = statistics.median(t["kv_hop_s"] for t in traces)
    kv_bytes = traces[-1]["kv_bytes"]
    obj_size = traces[-1]["kv_object_size"]
    locations = traces[-1]["kv_locations"]
    return {
        "http_tpot_ms": tpot * 1000, "engine_step_ms": step * 1000,
        "tpot_ratio": tpot / step,
        "ttft_1024_ms": ttft * 1000, "prefill_compute_ms": prefill * 1000,
        "kv_hop_ms": hop * 1000, "rest_ms": (ttft - prefill - hop) * 1000,
        "hop_share": hop / ttft,
        "kv_package_bytes": kv_bytes, "kv_object_bytes": obj_size,
        "kv_locations": {
            "prefill_node": topo.prefill_id in locations,
            "decode_node": topo.decode_id in locations,
            "head_node": topo.head_id in locations,
        },
        "rounds": rounds,
    }


def _run(rounds: int, decode_tokens: int) -> dict:
    """The cluster, the app and the engine alone side by side; the summary."""
    import torch
    from ray import serve

    from app.config import EngineConfig
    from app.engine_core import EngineCore
    from deployments.builder import build_app
    from tests.cluster import phase_args, split_topology, wait_ready

    with split_topology(prefill_slots=1, decode_slots=1) as topo:
        serve.run(build_app(phase_args()), name="splitserve", route_prefix="/",
                  blocking=False)
        wait_ready(topo.url, timeout_s=300)
        torch.set_num_threads(1)
        core = EngineCore(EngineConfig(num_threads=1))
        handle = serve.get_app_handle("splitserve")
        measured = _measure_rounds(topo.url, core, handle, rounds, decode_tokens)
        return _summarize(topo, *measured, rounds)


def _print_results(r: dict) -> None:
    ok = lambda cond: "PASS" if cond else "FAIL"  # noqa: E731
    print("\nFull split path (3-node cluster, 1 torch thread per phase) vs engine alone")
    print(f"  TPOT over HTTP streaming, concurrency 1 : {r['http_tpot_ms']:8.1f} ms")
    print(f"  engine decode step, batch 1             : {r['engine_step_ms']:8.1f} ms")
    print(f"  ratio (target <= 1.15)                  : {r['tpot_ratio']:8.2f}  "
          f"{ok(r['tpot_ratio'] <= 1.15)}")
    print(f"  TTFT, 1024-token prompt                 : {r['ttft_1024_ms']:8.1f} ms")
    print(f"    prefill compute                       : {r['prefill_compute_ms']:8.1f} ms")
    print(f"    KV hop (prefill return -> decode has it): {r['kv_hop_ms']:6.1f} ms")
    print(f"    rest (queueing, routing, delivery)    : {r['rest_ms']:8.1f} ms")
    print(f"  KV hop share of TTFT (target <= 15%)    : {100 * r['hop_share']:7.1f} %  "
          f"{ok(r['hop_share'] <= 0.15)}")
    print(f"  KV package bytes                        : {r['kv_package_bytes']:>12,}")
    print(f"  object-store object bytes               : {r['kv_object_bytes']:>12,}  "
          f"(+{r['kv_object_bytes'] - r['kv_package_bytes']} B metadata)")
    print(f"  object locations                        : {r['kv_locations']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    results = _run(args.rounds, args.decode_tokens)
    _print_results(results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
