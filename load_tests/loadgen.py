"""Load generator for OpenAI-compatible servers: streaming requests, per-class latency,
throughput and goodput, JSON results and PNG plots.

Examples (see ``--help``)::

    # fixed lengths, Poisson arrivals, three rates, goodput under SLOs
    python -m load_tests.loadgen --endpoint completions --input-len 256 --output-len 64 \\
        --rates 0.5,1,2 --num-requests 40 --slo ttft:2000 tpot:100

    # steady decode streams while long documents arrive; each class reported on its own
    python -m load_tests.loadgen --endpoint completions \\
        --class name=decode,input=64,output=256,concurrency=4,n=400,background=1 \\
        --class name=docs,input=1024,output=16,rate=0.25,n=8

    # a chat-like mix (lognormal lengths) at fixed concurrency
    python -m load_tests.loadgen --endpoint chat --class chat --concurrency 8 --num-requests 64

Every run is bounded: at most ``--num-requests`` per stream and ``--duration`` seconds of
issuing, then at most ``--drain-timeout`` seconds for the requests still running. Traffic
goes only to loopback addresses unless ``--allow-remote`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from tqdm.auto import tqdm

from load_tests.client import ENDPOINT_PATHS, is_local_url, send_streaming, served_model
from load_tests.metrics import (
    BREAKDOWN_PHASES,
    RequestRecord,
    attach_server_timings,
    breakdown,
    parse_slos,
    summarize_by_class,
)
from load_tests.workloads import (
    LengthDist,
    PromptFactory,
    PromptFile,
    RequestClass,
    RequestSpec,
    arrival_gaps,
    pick_class,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(slots=True)
class Stream:
    """One arrival process: Poisson/gamma at ``rate`` or a closed loop of ``concurrency``
    clients, issuing at most ``num_requests`` requests drawn from ``classes`` by weight."""

    name: str
    classes: list[RequestClass]
    num_requests: int
    rate: float | None = None
    concurrency: int | None = None
    burstiness: float = 1.0
    background: bool = False

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError(f"stream {self.name}: exactly one of rate or concurrency")
        if self.num_requests < 1:
            raise ValueError(f"stream {self.name}: num_requests must be >= 1")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "classes": [c.name for c in self.classes],
                "num_requests": self.num_requests, "rate": self.rate,
                "concurrency": self.concurrency, "burstiness": self.burstiness,
                "background": self.background}


@dataclass(slots=True)
class LoadPlan:
    base_url: str
    endpoint: str  # "chat" | "completions"
    streams: list[Stream]
    duration_s: float  # stop issuing after this long
    drain_timeout_s: float = 120.0  # then wait at most this long for requests in flight
    request_timeout_s: float = 300.0
    model: str | None = None
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}")
        if not self.streams:
            raise ValueError("no request streams")
        if self.duration_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("duration must be positive and the drain timeout non-negative")
        if all(s.background for s in self.streams):
            raise ValueError("background classes need at least one foreground class to follow")


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0


SpecMaker = Callable[[RequestClass, random.Random], RequestSpec]

_UNFINISHED = "not finished within the run's time limit"


def _build_specs(plan: LoadPlan, make_spec: SpecMaker) -> list[list[RequestSpec]]:
    """Every stream's requests, drawn before the clock starts, seeded from ``plan.seed``."""
    specs = []
    for i, stream in enumerate(plan.streams):
        rng = random.Random(f"{plan.seed}/{i}/specs")
        specs.append([make_spec(pick_class(stream.classes, rng), rng)
                      for _ in range(stream.num_requests)])
    return specs


class _LoadRun:
    """One measured run: its clock, the streams' arrival loops and the records they leave."""

    def __init__(self, plan: LoadPlan, client: httpx.AsyncClient, url: str,
                 specs: list[list[RequestSpec]], bar: tqdm) -> None:
        self.plan, self.client, self.url, self.specs, self.bar = plan, client, url, specs, bar
        self.result = RunResult()
        self.start = time.perf_counter()
        self.deadline = self.start + plan.duration_s
        self.foreground_done = asyncio.Event()

    async def one(self, spec: RequestSpec) -> None:
        plan = self.plan
        body = spec.body(plan.endpoint, plan.model, plan.temperature)
        sent = time.perf_counter() - self.start
        try:
            rec = await send_streaming(self.client, self.url, body, plan.endpoint,
                                       spec.request_class, self.start, spec.input_tokens)
        except asyncio.CancelledError:
            self.result.records.append(RequestRecord(spec.request_class, sent,
                                                     spec.input_tokens, error=_UNFINISHED))
            raise
        self.result.records.append(rec)
        self.bar.update(1)

    def stopped(self, stream: Stream) -> bool:
        return time.perf_counter() >= self.deadline or (stream.background
                                                        and self.foreground_done.is_set())

    async def pause(self, stream: Stream, seconds: float) -> None:
        seconds = min(seconds, max(0.0, self.deadline - time.perf_counter()))
        if stream.background:
            try:
                await asyncio.wait_for(self.foreground_done.wait(), seconds)
            except asyncio.TimeoutError:
                pass
        else:
            await asyncio.sleep(seconds)

    async def open_loop(self, stream: Stream, todo: list[RequestSpec],
                        rng: random.Random) -> None:
        assert stream.rate is not None
        gaps = arrival_gaps(stream.rate, stream.burstiness, rng)
        tasks = []
        for i, spec in enumerate(todo):
            if i:
                await self.pause(stream, next(gaps))
            if self.stopped(stream):
                break
            tasks.append(asyncio.create_task(self.one(spec)))
        await asyncio.gather(*tasks)

    async def closed_loop(self, stream: Stream, todo: list[RequestSpec]) -> None:
        assert stream.concurrency is not None
        queue = iter(todo)

        async def client_loop() -> None:
            for spec in queue:  # shared: each spec goes to exactly one client
                if self.stopped(stream):
                    return
                await self.one(spec)

        await asyncio.gather(*(client_loop() for _ in range(stream.concurrency)))

    async def drive(self, i: int, stream: Stream) -> None:
        rng = random.Random(f"{self.plan.seed}/{i}/arrivals")
        if stream.rate is not None:
            await self.open_loop(stream, self.specs[i], rng)
        else:
            await self.closed_loop(stream, self.specs[i])

    async def all_streams(self) -> None:
        streams = list(enumerate(self.plan.streams))
        fg = [asyncio.create_task(self.drive(i, s)) for i, s in streams if not s.background]
        bg = [asyncio.create_task(self.drive(i, s)) for i, s in streams if s.background]
        try:
            await asyncio.gather(*fg)
        finally:
            self.foreground_done.set()
        await asyncio.gather(*bg)

    async def run(self) -> RunResult:
        runner = asyncio.create_task(self.all_streams())
        try:
            await asyncio.wait_for(runner, self.plan.duration_s + self.plan.drain_timeout_s)
        except asyncio.TimeoutError:
            pass  # the requests still running were recorded as unfinished
        finally:
            self.result.duration_s = time.perf_counter() - self.start
        return self.result


async def run_load(plan: LoadPlan, make_spec: SpecMaker, *, progress: bool = True,
                   warmup: int = 0,
                   transport: httpx.AsyncBaseTransport | None = None) -> RunResult:
    """Issue the plan's streams against the server and time every request.

    Requests are built before the clock starts (the client must not steal the server's CPU
    while it runs); streams are seeded from ``plan.seed``, so two runs send the same prompts
    at the same offsets.
    """
    url = plan.base_url.rstrip("/") + ENDPOINT_PATHS[plan.endpoint]
    specs = _build_specs(plan, make_spec)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(plan.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        # not measured: first-request costs (threads, allocations); prompts of their own,
        # so no measured request finds its prompt in the server's prefix cache
        rng = random.Random(f"{plan.seed}/warmup")
        for _ in range(warmup):
            spec = make_spec(pick_class(plan.streams[0].classes, rng), rng)
            await send_streaming(client, url, spec.body(plan.endpoint, plan.model,
                                                        plan.temperature),
                                 plan.endpoint, spec.request_class, time.perf_counter())

        bar = tqdm(total=sum(s.num_requests for s in plan.streams), unit="req",
                   disable=not progress, dynamic_ncols=True)
        try:
            return await _LoadRun(plan, client, url, specs, bar).run()
        finally:
            bar.close()


# ---- CLI ---------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m load_tests.loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root; the /v1/... path is added (default %(default)s)")
    p.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions",
                   help="completions sends token-id prompts of the exact length; chat sends "
                   "templated text measured with the tokenizer (default %(default)s)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's "
                   "first /v1/models entry)")
    p.add_argument("--tokenizer", default=None,
                   help="model whose tokenizer measures synthetic prompts (default: the app's "
                   "default model)")
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", default="256",
                   help="prompt tokens of the single 'fixed' class: N, uniform:A:B or "
                   "lognormal:MEDIAN:SIGMA[:MIN:MAX] (default %(default)s)")
    w.add_argument("--output-len", default="64", help="output tokens, same forms")
    w.add_argument("--class", dest="classes", action="append", default=[], metavar="SPEC",
                   help="a request class (repeatable): name=N,input=L,output=L[,weight=W]"
                   "[,rate=R|concurrency=C][,n=N][,background=1][,ignore_eos=0]; 'chat' is a "
                   "chat-like preset. Classes with rate= or concurrency= get their own stream")
    w.add_argument("--dataset", default=None,
                   help="JSONL prompts: {prompt|messages, [max_tokens], [class]} per line")
    w.add_argument("--no-ignore-eos", action="store_true",
                   help="let generation stop at EOS (default: ignore_eos, fixed lengths)")
    w.add_argument("--temperature", type=float, default=0.0)
    a = p.add_argument_group("arrivals (the shared stream of classes without their own)")
    g = a.add_mutually_exclusive_group()
    g.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    g.add_argument("--rates", default=None,
                   help="comma-separated rates: one run each, plus goodput-vs-rate plot")
    g.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: this many requests in flight")
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier")
    b = p.add_argument_group("bounds")
    b.add_argument("--num-requests", type=int, default=100,
                   help="requests per stream (classes' n= overrides) (default %(default)s)")
    b.add_argument("--duration", type=float, default=600.0,
                   help="seconds of issuing per run at most (default %(default)s)")
    b.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds to wait for requests in flight after issuing stops")
    b.add_argument("--request-timeout", type=float, default=300.0)
    b.add_argument("--warmup", type=int, default=0, help="unmeasured requests sent first")
    o = p.add_argument_group("output")
    o.add_argument("--slo", nargs="+", default=[], metavar="NAME:MS",
                   help="goodput targets, e.g. --slo ttft:2000 tpot:100 (ttft, tpot, e2e)")
    o.add_argument("--out", default=None, help="results directory (default "
                   "load_tests/results/<time>)")
    o.add_argument("--label", default=None, help="a name for this server/config in results")
    o.add_argument("--server-timings", action="store_true",
                   help="after each run, join the server's own timings of each request "
                   "(GET /debug/requests: queueing, prefill, KV hop, decode) and report the "
                   "per-class breakdown")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --base-url (you must own that server)")
    args = p.parse_args(argv)
    if not args.allow_remote and not is_local_url(args.base_url):
        p.error(f"{args.base_url} is not a loopback address; pass --allow-remote to load a "
                "server you run elsewhere")
    if args.num_requests < 1 or args.num_requests > 100_000:
        p.error("--num-requests must be in [1, 100000]")
    if not 0 < args.duration <= 24 * 3600:
        p.error("--duration must be in (0, 86400] seconds")
    return args


def _classes(args: argparse.Namespace) -> list[RequestClass]:
    ignore_eos = not args.no_ignore_eos
    if args.classes:
        return [RequestClass.parse(s, ignore_eos=ignore_eos) for s in args.classes]
    output = LengthDist.parse(args.output_len)
    if args.dataset:
        return [RequestClass("jsonl", None, output, ignore_eos=ignore_eos)]
    return [RequestClass("fixed", LengthDist.parse(args.input_len), output,
                         ignore_eos=ignore_eos)]


def build_streams(classes: list[RequestClass], *, rate: float | None, concurrency: int | None,
                  burstiness: float, num_requests: int) -> list[Stream]:
    """The shared stream (classes without their own arrivals) plus one stream per class that
    has its own rate or concurrency."""
    streams = []
    shared = [c for c in classes if not c.own_stream]
    if shared:
        if rate is None and concurrency is None:
            raise ValueError("give --rate, --rates or --concurrency for classes "
                             f"{[c.name for c in shared]} (or rate=/concurrency= per class)")
        streams.append(Stream("shared", shared, num_requests, rate, concurrency, burstiness))
    for c in classes:
        if c.own_stream:
            streams.append(Stream(c.name, [c], c.num_requests or num_requests, c.rate,
                                  c.concurrency, burstiness, c.background))
    return streams


def _spec_maker(args: argparse.Namespace, classes: list[RequestClass]) -> SpecMaker:
    if any(c.input_len is None for c in classes):
        if not args.dataset:
            raise ValueError("a class without input= needs --dataset")
        prompts = PromptFile.load(args.dataset)
    else:
        prompts = None
    factory: PromptFactory | None = None
    if any(c.input_len is not None for c in classes):
        from app.config import DEFAULT_MODEL, EngineConfig
        from app.model_loader import load_tokenizer

        factory = PromptFactory(load_tokenizer(EngineConfig(model=args.tokenizer
                                                            or DEFAULT_MODEL)))

    def make(request_class: RequestClass, rng: random.Random) -> RequestSpec:
        if request_class.input_len is None:
            assert prompts is not None
            return prompts.make(request_class, rng)
        assert factory is not None
        return factory.make(request_class, args.endpoint, rng)

    return make


def _fmt(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


async def fetch_server_timings(base_url: str, limit: int) -> list[dict[str, Any]]:
    """The server's timings of its last ``limit`` requests (``GET /debug/requests``)."""
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.get(base_url.rstrip("/") + "/debug/requests",
                                params={"limit": limit})
        resp.raise_for_status()
        return list(resp.json().get("data") or [])


def format_breakdown(by_class: dict[str, dict[str, Any]]) -> str:
    """Mean (and p90) of each server-side phase per class, in ms."""
    names = [p.removesuffix("_s") for p in BREAKDOWN_PHASES]
    lines = [f"{'class':<12}{'n':>5}" + "".join(f"{n:>19}" for n in names)
             + f"{'client e2e':>12}"]
    for name, b in by_class.items():
        cells = []
        for phase in BREAKDOWN_PHASES:
            d = b["phases_ms"][phase]
            cells.append(f"{_fmt(d['mean'])} (p90 {_fmt(d['p90'])})" if d["count"] else "-")
        lines.append(f"{name[:12]:<12}{b['requests']:>5}" + "".join(f"{c:>19}" for c in cells)
                     + f"{_fmt(b['client_e2e_ms_mean']):>12}")
    return "\n".join(lines)


def format_summary(summary: dict[str, Any]) -> str:
    head = (f"{'class':<12}{'ok':>5}{'fail':>5}{'req/s':>8}{'tok/s':>8}{'TTFT p50':>10}"
            f"{'p99':>8}{'TPOT p50':>10}{'p99':>7}{'ITL p99':>9}{'E2E p50':>9}{'goodput':>9}")
    lines = [head]
    rows = [("overall", summary["overall"]), *summary["classes"].items()]
    for name, s in rows:
        lines.append(
            f"{name[:12]:<12}{s['completed']:>5}{s['failed']:>5}"
            f"{s['request_throughput']:>8.2f}{s['output_throughput']:>8.1f}"
            f"{_fmt(s['ttft_ms']['p50']):>10}{_fmt(s['ttft_ms']['p99']):>8}"
            f"{_fmt(s['tpot_ms']['p50']):>10}{_fmt(s['tpot_ms']['p99']):>7}"
            f"{_fmt(s['itl_ms']['p99']):>9}{_fmt(s['e2e_ms']['p50']):>9}"
            f"{s['goodput']:>9.2f}")
    errors = summary["overall"]["errors"]
    for msg, n in errors.items():
        lines.append(f"  {n} x {msg}")
    return "\n".join(lines)


def _rates(args: argparse.Namespace) -> list[float | None]:
    if not args.rates:
        return [args.rate]
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise ValueError("--rates must be positive numbers")
    return [*rates]


def _run_title(args: argparse.Namespace, rate: float | None) -> str:
    if rate is not None:
        return f"rate {rate:g}/s"
    return f"concurrency {args.concurrency}" if args.concurrency else "per-class streams"


def sweep_seed(seed: int, run_index: int) -> int:
    """The prompts' and arrivals' seed of run ``run_index`` of a rate sweep. Each run sends
    prompts of its own: a server with a prefix cache would otherwise serve a later rate's
    prompts from the cache the earlier runs filled (the first run keeps ``seed``)."""
    return seed + run_index


async def _run_rate(args: argparse.Namespace, rate: float | None, base_streams: list[Stream],
                    model: str, make_spec: SpecMaker, slos: dict[str, float],
                    run_index: int = 0,
                    ) -> tuple[RunResult, list[RequestRecord], dict[str, Any]]:
    """One run with the shared stream at ``rate``: its result, records by send time and
    summary (with the server-side breakdown when asked for)."""
    streams = [replace(s, rate=rate) if s.name == "shared" and rate is not None else s
               for s in base_streams]
    plan = LoadPlan(args.base_url, args.endpoint, streams, args.duration,
                    args.drain_timeout, args.request_timeout, model, args.temperature,
                    sweep_seed(args.seed, run_index))
    res = await run_load(plan, make_spec, progress=not args.no_progress, warmup=args.warmup)
    records = sorted(res.records, key=lambda r: r.sent_at)
    summary = summarize_by_class(records, res.duration_s, slos)
    if args.server_timings:
        traces = await fetch_server_timings(args.base_url, len(records) + args.warmup)
        matched = attach_server_timings(records, traces)
        names = list(summary["classes"])
        summary["breakdown"] = {
            n: breakdown([r for r in records if r.request_class == n]) for n in names}
        summary["server_timings_matched"] = matched
    return res, records, summary


def _print_run(args: argparse.Namespace, title: str, res: RunResult,
               records: list[RequestRecord], summary: dict[str, Any]) -> None:
    print(f"\n== {args.label or args.base_url} · {title} · {res.duration_s:.1f} s ==")
    print(format_summary(summary), flush=True)
    if "breakdown" in summary:
        print(f"server-side phases, ms ({summary['server_timings_matched']} of "
              f"{len(records)} requests matched):")
        print(format_breakdown(summary["breakdown"]), flush=True)


def _plot_run(args: argparse.Namespace, rate: float | None, n_rates: int,
              records: list[RequestRecord], out_dir: Path, title: str) -> None:
    from load_tests.plots import plot_latency_cdfs

    suffix = f"_rate{rate:g}" if n_rates > 1 and rate is not None else ""
    by_class: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_class.setdefault(r.request_class, []).append(r.as_dict())
    plot_latency_cdfs(by_class, out_dir / f"latency_cdf{suffix}.png",
                      f"{args.label or ''} {title}".strip())


def _results_doc(args: argparse.Namespace, model: str, slos: dict[str, float],
                 classes: list[RequestClass], base_streams: list[Stream]) -> dict[str, Any]:
    return {
        "config": {
            "label": args.label, "base_url": args.base_url, "endpoint": args.endpoint,
            "model": model, "temperature": args.temperature, "seed": args.seed,
            "duration_s": args.duration, "drain_timeout_s": args.drain_timeout,
            "slos_ms": slos, "argv": sys.argv[1:],
            "classes": [asdict(c) for c in classes],
            "streams": [s.describe() for s in base_streams],
        },
        "runs": [],
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    slos = parse_slos(args.slo)
    classes = _classes(args)
    rates = _rates(args)
    base_streams = build_streams(classes, rate=rates[0], concurrency=args.concurrency,
                                 burstiness=args.burstiness, num_requests=args.num_requests)
    if args.rates and not any(s.name == "shared" for s in base_streams):
        raise ValueError("--rates applies to the shared stream: some class must have no "
                         "rate=/concurrency= of its own")
    model = args.model
    if model is None:
        async with httpx.AsyncClient(timeout=30) as client:
            model = await served_model(client, args.base_url)
    make_spec = _spec_maker(args, classes)
    out_dir = Path(args.out) if args.out else RESULTS_DIR / datetime.now().strftime(
        "%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = _results_doc(args, model, slos, classes, base_streams)
    for k, rate in enumerate(rates):
        res, records, summary = await _run_rate(args, rate, base_streams, model, make_spec,
                                                slos, run_index=k)
        results["runs"].append({"rate": rate, "concurrency": args.concurrency,
                                "summary": summary,
                                "requests": [r.as_dict() for r in records]})
        title = _run_title(args, rate)
        _print_run(args, title, res, records, summary)
        if not args.no_plots:
            _plot_run(args, rate, len(rates), records, out_dir, title)
    if not args.no_plots and len(rates) > 1:
        from load_tests.plots import plot_goodput_vs_rate

        plot_goodput_vs_rate({args.label or "server": [(run["rate"], run["summary"]["overall"])
                                                       for run in results["runs"]]},
                             out_dir / "goodput_vs_rate.png", slos)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results: {out_dir / 'results.json'}")
    return results


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        asyncio.run(_main(args))
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
