"""Capacity planner CLI: ``python -m planner {profile,simulate,search,validate}``.

    # measure this machine (starts a 2-node local Ray cluster for the KV hop: hold the lock)
    flock /tmp/splitserve-ray-cluster.lock .venv/bin/python -m planner profile \\
        --out docs/planner/profile-local.json
    # simulate a workload on a fleet: measured devices or roofline presets
    python -m planner simulate --system split --prefill H100 --decode H100 \\
        --num-prefill 1 --num-decode 2 --model llama-3.1-8b --rate 4 \\
        --input-len lognormal:2048:0.6:256:8000 --output-len lognormal:256:0.6:16:1024 \\
        --slo ttft:1000 tpot:50
    # the same with half of each prompt cached, four answers per request, 2048-token chunks
    python -m planner simulate ... --prefix-hit-rate 0.5 --n 4 --prefill-chunk 2048
    # the best split and colocated fleets per dollar
    python -m planner search --hardware H100,H200,A100,L4 --model llama-3.1-8b ...
    # predicted vs measured on real load-generator runs
    python -m planner validate --profile P.json --split A/results.json \\
        --colocated B/results.json [--split-config serve_configs/local.yaml \\
        --colocated-config serve_configs/local-colocated.yaml]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from load_tests.metrics import parse_slos
from load_tests.workloads import LengthDist
from planner import hardware, search, validate, validate_inputs
from planner.hardware import DeviceProfile
from planner.sim import (
    COLOCATED_POLICIES,
    KV_LAYOUTS,
    ColocatedSystem,
    EngineLimits,
    SplitSystem,
    Workload,
    load_trace,
    simulate,
)


def _devices(args: argparse.Namespace) -> dict[str, DeviceProfile]:
    devs: dict[str, DeviceProfile] = {}
    if getattr(args, "profile", None):
        from planner.profile import load_devices

        devs.update(load_devices(args.profile))
    if args.model in hardware.MODELS:
        model = hardware.MODELS[args.model]
    else:  # a transformers config.json
        model = hardware.ModelSpec.from_config(json.loads(Path(args.model).read_text()),
                                               name=Path(args.model).parent.name or None)
    eff = hardware.Efficiency()
    eff_hop = getattr(args, "hop_gbs", None)
    for name, spec in hardware.HARDWARE.items():
        try:
            devs[name] = hardware.roofline_profile(spec, model, eff=eff, hop_gbs=eff_hop)
        except ValueError:
            pass  # the model does not fit this device
    return devs


def _limits(args: argparse.Namespace) -> EngineLimits:
    return EngineLimits(max_batch_size=args.max_batch_size, token_budget=args.token_budget,
                        prefill_max_rows=args.prefill_max_rows,
                        kv_layout=args.kv_layout,
                        prefill_chunk_tokens=args.prefill_chunk,
                        prefill_batch_tokens=args.prefill_batch_tokens,
                        prefill_fairness_s=args.prefill_fairness_s,
                        prefill_routing=args.prefill_routing,
                        local_prefill_threshold=args.local_prefill_threshold,
                        local_prefill_when_busy=args.local_prefill_when_busy,
                        prefill_busy_tokens=args.prefill_busy_tokens)


def _workload(args: argparse.Namespace) -> Workload:
    return Workload(args.rate, LengthDist.parse(args.input_len),
                    LengthDist.parse(args.output_len), args.num_requests, args.burstiness,
                    args.seed, prefix_hit_rate=args.prefix_hit_rate, n=args.n)


def _common(p: argparse.ArgumentParser, *, gpu_defaults: bool) -> None:
    p.add_argument("--profile", default=None, help="measured profile JSON (devices cpu-1t, "
                   "cpu-2t ...) besides the roofline presets")
    p.add_argument("--model", default="llama-3.1-8b" if gpu_defaults else "smollm2-135m",
                   help=f"model of the roofline profiles: {', '.join(sorted(hardware.MODELS))} "
                   "or the path of a transformers config.json")
    p.add_argument("--hop-gbs", type=float, default=None,
                   help="KV hop bandwidth GB/s for roofline devices (default: their network)")
    p.add_argument("--input-len", default="lognormal:2048:0.6:256:8000")
    p.add_argument("--output-len", default="lognormal:256:0.6:16:1024")
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson by default)")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", nargs="+", default=["ttft:1000", "tpot:50"], metavar="NAME:MS")
    p.add_argument("--max-batch-size", type=int, default=256 if gpu_defaults else 16)
    p.add_argument("--token-budget", type=int, default=8192 if gpu_defaults else 4096)
    p.add_argument("--prefill-max-rows", type=int, default=64 if gpu_defaults else 8)
    _kv_layout_arg(p, default="inplace" if gpu_defaults else "paged")
    p.add_argument("--prefill-chunk", type=int, default=2048 if gpu_defaults else 256,
                   help="prefill_chunk_tokens: at most this many tokens per prefill pass, "
                   "long prompts in chunks (the GPU serve configs use 2048, EngineConfig 256)")
    p.add_argument("--prefill-batch-tokens", type=int, default=None,
                   help="prefill_batch_tokens: a pass takes no more prompts once it holds this "
                   "many tokens (serve_configs/local.yaml uses 128; default: no limit)")
    p.add_argument("--prefill-fairness-s", type=float, default=5.0,
                   help="a prompt that waited this long leads every other prefill pass")
    p.add_argument("--prefill-routing", choices=("affinity", "least_loaded"),
                   default="affinity", help="prefill replica choice: the app's prefix-"
                   "affinity router (a home replica unless 4 requests busier) or least loaded")
    _local_prefill_args(p)
    p.add_argument("--prefix-hit-rate", type=float, default=0.0,
                   help="fraction of each prompt's tokens served by the prefix cache (whole "
                   "16-token blocks; only the rest is computed, the KV hop and decode carry "
                   "the whole prompt)")
    p.add_argument("--n", type=int, default=1,
                   help="answers per request: one prefill, n decode sequences; a request is "
                   "good when every answer meets the SLOs")


def _local_prefill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="split: a prompt shorter than this many tokens is prefilled on a decode "
                   "replica, in its decode steps (the app's local_prefill_threshold); 0: none")
    p.add_argument("--local-prefill-when-busy", type=int, default=128,
                   help="split: a prompt shorter than this many tokens goes to whichever side "
                   "has fewer tokens ahead of it while the prefill phase is backed up (the "
                   "app's local_prefill_when_busy and its default); 0: every prompt hops")
    p.add_argument("--prefill-busy-tokens", type=int, default=None,
                   help="split: the prefill phase is backed up while the prompt tokens sent to "
                   "it whose streams have not started are at least this many (default: one "
                   "prefill pass, min(--token-budget, --prefill-chunk), as the app's)")


def _policy_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", choices=COLOCATED_POLICIES, default="mixed",
                   help="how a replica that prefills and decodes shares its engine: mixed = "
                   "this app (engine.mixed_batch, the default): while sequences decode, "
                   "waiting prompts' chunks ride in the decode steps under one prefill pass's "
                   "budget, decode rows included, at least a quarter of it for the chunks; "
                   "interleave = this app with mixed_batch: false: prefill passes between the "
                   "decode steps; chunked = vLLM/Sarathi-style, not this app: the oldest "
                   "prompt's --chunk-tokens in every step (colocated only). For the split: "
                   "its decode replicas' local prompts (mixed or interleave)")


def _kv_layout_arg(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--kv-layout", choices=KV_LAYOUTS, default=default,
                   help="the decode replica's KV: paged = this engine's pool (16-token "
                   "blocks, each sequence reserving prompt + max_tokens in whole blocks; a "
                   "step gathers rows padded to the longest unless that copies over twice "
                   "the positions held, then exactly); inplace = the same pool, every row "
                   "attending only its own positions (a paged-attention kernel such as "
                   "vLLM's); padded = the contiguous buffer the engine had before its pool "
                   f"(replaying runs of that engine). Default: {default}")


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m planner", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_profile_parser(sub)
    _add_stack_parser(sub)
    _add_simulate_parser(sub)
    _add_validate_parser(sub)
    _add_search_parser(sub)
    return ap


def _add_profile_parser(sub: Any) -> None:
    pp = sub.add_parser("profile", help="measure this machine and write a profile JSON")
    pp.add_argument("--out", default="docs/planner/profile-local.json")
    pp.add_argument("--threads", default="1,2", help="torch thread counts to profile")
    pp.add_argument("--no-hop", action="store_true", help="skip the Ray KV-hop measurement")
    pp.add_argument("--quick", action="store_true", help="fewer points (a smoke run)")
    pp.add_argument("--dtype", default="auto",
                    help="engine.dtype to profile (auto: what the serve configs resolve to)")
    pp.add_argument("--weights", default=None,
                    help="engine.weights to profile (int8: weight-only int8 panels; "
                    "int8-g<N>: a scale per N of k)")
    pp.add_argument("--model", default=None, help="engine.model to profile (default: the "
                    "embedded SmolLM2; a compressed-tensors int8 checkpoint runs int8 panels)")
    pp.add_argument("--main-thread", action="store_true",
                    help="time the passes on the calling thread (default: one worker thread, as "
                    "a replica's engine thread runs them)")


def _add_stack_parser(sub: Any) -> None:
    pk = sub.add_parser("stack", help="time the serving stack around the engine on a live "
                        "app (decode TPOT vs streams, lone-request TTFT) and write a JSON")
    pk.add_argument("--url", default="http://127.0.0.1:8000", help="the app (loopback only)")
    pk.add_argument("--out", required=True)


def _add_simulate_parser(sub: Any) -> None:
    ps = sub.add_parser("simulate", help="simulate one system on a workload or trace")
    _common(ps, gpu_defaults=False)
    ps.add_argument("--system", choices=("split", "colocated"), default="split")
    ps.add_argument("--prefill", default="cpu-1t", help="device of prefill replicas")
    ps.add_argument("--decode", default="cpu-1t", help="device of decode replicas")
    ps.add_argument("--device", default="cpu-2t", help="device of colocated replicas")
    ps.add_argument("--num-prefill", type=int, default=1)
    ps.add_argument("--num-decode", type=int, default=1)
    ps.add_argument("--num-replicas", type=int, default=1)
    _policy_arg(ps)
    ps.add_argument("--chunk-tokens", type=int, default=512,
                    help="--policy chunked: prompt tokens per step")
    ps.add_argument("--trace", default=None, help="loadgen results.json or JSONL "
                    "{at,input,output} to replay instead of --rate/lengths")


def _add_validate_parser(sub: Any) -> None:
    pv = sub.add_parser("validate", help="predicted vs measured on load-generator runs")
    pv.add_argument("--profile", required=True)
    pv.add_argument("--split", default=None, help="results.json of the split app")
    pv.add_argument("--colocated", default=None, help="results.json of the colocated app")
    pv.add_argument("--slo", nargs="+", default=None, metavar="NAME:MS",
                    help="default: the SLOs the runs were made with")
    pv.add_argument("--engine-profile", nargs="+", default=[],
                    help="profiles whose prefill/decode fits replace --profile's (e.g. taken "
                    "under the same lock right before the runs); hop and overhead stay")
    pv.add_argument("--slowdown", type=float, default=1.0,
                    help="multiply every engine pass by this (the share of the cores the "
                    "serving stack takes; e.g. calibrated on the lowest-rate run)")
    pv.add_argument("--stack-split", default=None,
                    help="stack JSON measured on the split app: its per-step streaming cost "
                    "and per-request overhead are added to cpu-1t")
    pv.add_argument("--stack-colocated", default=None,
                    help="stack JSON measured on the colocated app, added to cpu-2t")
    pv.add_argument("--own-cores", action="store_true",
                    help="model the split's phases on a core each, the stack aside (by "
                    "default, where --stack-split has CPU figures, the phases and the stack "
                    "share the machine's cores: SplitSystem.shared_cores)")
    _kv_layout_arg(pv, default="paged")
    pv.add_argument("--policy", choices=("mixed", "interleave"), default="mixed",
                    help="the colocated replica's (and the split's decode replicas'): mixed = "
                    "engine.mixed_batch on (the default), interleave = off, or runs of an "
                    "engine from before mixed batching")
    _local_prefill_args(pv)
    pv.add_argument("--split-config", default=None, metavar="YAML",
                    help="the split run's Serve config (e.g. serve_configs/local.yaml): its "
                    "engine bounds and routing replace the flags above for the split")
    pv.add_argument("--colocated-config", default=None, metavar="YAML",
                    help="the colocated run's Serve config, likewise for the colocated app")
    pv.add_argument("--json", default=None, help="also write the comparison here")


def _add_search_parser(sub: Any) -> None:
    pz = sub.add_parser("search", help="best split vs colocated fleet per dollar")
    _common(pz, gpu_defaults=True)
    pz.add_argument("--hardware", default="H100,H200,A100,L4",
                    help="device kinds to place phases on (presets or profile devices)")
    pz.add_argument("--max-per-phase", type=int, default=4)
    pz.add_argument("--budget", type=float, default=None,
                    help="$/hour to compare at (default: the dearest candidate's price)")
    pz.add_argument("--target", type=float, default=0.9, help="SLO attainment for goodput")
    pz.add_argument("--colocated-policies", default="mixed,chunked",
                    help="colocated variants to search (comma-separated): mixed = this app "
                    "(engine.mixed_batch, its default), interleave = this app with "
                    "mixed_batch: false, chunked = vLLM/Sarathi-style with --chunk-tokens "
                    "per step (not this app)")
    pz.add_argument("--chunk-tokens", type=int, default=512,
                    help="the chunked variant's prompt tokens per step")
    pz.add_argument("--plot", default=None, help="PNG of goodput vs price")
    pz.add_argument("--json", default=None)


# ---- profile, stack ----------------------------------------------------------------------


def _cmd_profile(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    from planner.profile import run_profile

    prof = run_profile(Path(args.out), threads=[int(t) for t in args.threads.split(",")],
                       hop=not args.no_hop, quick=args.quick,
                       worker_thread=not args.main_thread, dtype=args.dtype,
                       weights=args.weights, model=args.model)
    print(json.dumps(prof["devices"], indent=1))
    print(f"profile: {args.out}")
    return 0


def _cmd_stack(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    from load_tests.client import is_local_url
    from planner.profile import measure_stack

    if not is_local_url(args.url):
        ap.error(f"{args.url} is not a loopback address")
    stack = measure_stack(args.url)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(stack, indent=1))
    print(json.dumps(stack, indent=1))
    return 0


# ---- validate ----------------------------------------------------------------------------


def _cmd_validate(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    results = {k: v for k, v in (("split", args.split), ("colocated", args.colocated)) if v}
    if not results:
        ap.error("give --split and/or --colocated results")
    slos = parse_slos(args.slo) if args.slo else None
    limits = EngineLimits(kv_layout=args.kv_layout,
                          local_prefill_threshold=args.local_prefill_threshold,
                          local_prefill_when_busy=args.local_prefill_when_busy,
                          prefill_busy_tokens=args.prefill_busy_tokens)
    per_kind: dict[str, EngineLimits] = {}
    for kind, config in (("split", args.split_config), ("colocated", args.colocated_config)):
        try:
            per_kind[kind] = (validate.limits_of_app(config, limits) if config else limits)
        except (OSError, ValueError) as exc:
            ap.error(f"--{kind}-config: {exc}")
    engines = validate_inputs.engine_devices(args)
    devices = validate_inputs.validation_devices(engines, args)
    cores, stack = validate_inputs.shared_cores(args, engines.get("cpu-1t"))
    wide = validate_inputs.split_wide(args, engines, per_kind["split"], cores)
    comps = validate.validate(devices, results, slos, per_kind, args.policy, cores, stack,
                              wide)
    print(validate.table(comps))
    if args.json:
        Path(args.json).write_text(json.dumps(comps, indent=1))
    return 0


# ---- simulate ----------------------------------------------------------------------------


def _cmd_simulate(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    slos = parse_slos(args.slo)
    if args.system == "split" and args.policy == "chunked":
        ap.error("--policy chunked is a colocated variant; the split's decode replicas run "
                 "mixed or interleave")
    system = _simulated_system(args, _devices(args))
    if args.trace:  # the trace's lengths; --n and --prefix-hit-rate apply to every request
        runs = [[dataclasses.replace(a, n=args.n).with_prefix_hit_rate(args.prefix_hit_rate)
                 for a in arrivals] for arrivals in load_trace(args.trace)]
    else:
        runs = [_workload(args).arrivals()]
    for arrivals in runs:
        _print_summary(simulate(system, arrivals).summary(slos), slos)
    return 0


def _simulated_system(args: argparse.Namespace,
                      devs: dict[str, DeviceProfile]) -> SplitSystem | ColocatedSystem:
    limits = _limits(args)
    wanted = [args.prefill, args.decode] if args.system == "split" else [args.device]
    missing = sorted({d for d in wanted if d not in devs})
    if missing:
        raise SystemExit(f"planner: no device profile {', '.join(missing)} (known: "
                         f"{', '.join(sorted(devs))}); cpu-* devices come from a measured "
                         "profile: --profile docs/planner/profile-local.json")
    if args.system == "split":
        return SplitSystem(devs[args.prefill], devs[args.decode], args.num_prefill,
                           args.num_decode, limits, decode_policy=args.policy)
    return ColocatedSystem(devs[args.device], args.num_replicas, limits, args.policy,
                           args.chunk_tokens)


def _print_summary(s: dict[str, Any], slos: dict[str, float]) -> None:
    print(f"{s['system']}: {s['requests']} requests in {s['duration_s']:.1f} s")
    for m in ("ttft_ms", "tpot_ms", "e2e_ms"):
        d = s[m]
        if d["count"]:
            print(f"  {m[:-3]:<5} p50 {d['p50']:9.1f}  p90 {d['p90']:9.1f}  "
                  f"p99 {d['p99']:9.1f} ms")
    print(f"  throughput {s['request_throughput']:.2f} req/s, "
          f"{s['output_throughput']:.1f} tok/s; goodput {s['goodput']:.2f} req/s "
          f"({(s['good_fraction'] or 0) * 100:.0f}% at {slos})")
    print(f"  ${s['cost_per_m_output_tokens']:.3f} per M output tokens, "
          f"{s['energy_per_request_j']:.1f} J per request")


# ---- search ------------------------------------------------------------------------------


def _cmd_search(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    slos = parse_slos(args.slo)
    devs = _devices(args)
    kinds = [k.strip() for k in args.hardware.split(",") if k.strip()]
    missing = [k for k in kinds if k not in devs]
    if missing:
        ap.error(f"unknown or unfit hardware {missing}; known: {sorted(devs)}")
    policies = [k.strip() for k in args.colocated_policies.split(",") if k.strip()]
    unknown = [k for k in policies if k not in COLOCATED_POLICIES]
    if unknown:
        ap.error(f"unknown colocated policies {unknown}; known: {list(COLOCATED_POLICIES)}")
    result = search.search([devs[k] for k in kinds], _workload(args), slos,
                           limits=_limits(args), max_per_phase=args.max_per_phase,
                           target=args.target, colocated_policies=policies,
                           chunk_tokens=args.chunk_tokens,
                           log=lambda m: print(m, file=sys.stderr))
    budget = args.budget or max(c.price_per_hour for cs in result.values() for c in cs)
    print(search.table(result, budget))
    if args.plot:
        search.plot(result, args.plot, f"{args.model}, SLO {slos}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {k: [c.at_budget(budget) for c in cs] for k, cs in result.items()}, indent=1))
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace, argparse.ArgumentParser], int]] = {
    "profile": _cmd_profile,
    "stack": _cmd_stack,
    "validate": _cmd_validate,
    "simulate": _cmd_simulate,
    "search": _cmd_search,
}


def main(argv: list[str] | None = None) -> int:
    ap = _build_parser()
    args = ap.parse_args(argv)
    return _COMMANDS[args.cmd](args, ap)


if __name__ == "__main__":
    raise SystemExit(main())
