"""Each phase scales on its own signal, on a real three-node cluster (two replica slots per
phase), with short delays: prefill-heavy load scales prefill only, decode-heavy load scales
decode only, both return to their minimum when the load goes, a decode replica being removed
finishes its streams, and a short prompt prefilled on the decode replica decodes to the same
tokens as one that hops.

This module deploys its own app ("autoscale" under /autoscale). Apps other modules left
running are removed first (their replicas would hold the slots this module scales into); the
session's "splitserve" app, if it was one of them, is deployed again afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from ray import serve

from app.config import EngineConfig
from app.engine_core import LocalEngine
from app.messages import PrefillRequest
from app.sampling import SamplingParams
from tests.integration.conftest import APP, decode_replica_stats, wait_ready
from tests.integration.conftest import app_args as split_app_args

pytestmark = pytest.mark.integration

AS_APP = "autoscale"
ROUTE = "/autoscale"
LOCAL_THRESHOLD = 24  # prompts under 24 tokens are prefilled on the decode replica
SEQUENCES_PER_DECODE_REPLICA = 4

FAST_AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "initial_replicas": 1,
    "upscale_delay_s": 1.0,
    "downscale_delay_s": 3.0,
    "look_back_period_s": 2.0,
    "metrics_interval_s": 0.5,  # replicas push their metrics this often (Serve's default: 10 s)
}


def autoscale_args() -> dict[str, Any]:
    return split_app_args(
        prefill={"deployment_config": {"autoscaling_config": FAST_AUTOSCALING},
                 "scaling": {"target_queue_delay_s": 0.5}},
        decode={"deployment_config": {"autoscaling_config": FAST_AUTOSCALING,
                                      "graceful_shutdown_timeout_s": 300.0},
                "scaling": {"sequences_per_replica": SEQUENCES_PER_DECODE_REPLICA}},
        local_prefill_threshold=LOCAL_THRESHOLD,
        # a cut stream must show up here, not be resumed on the other replica by the ingress
        max_retries=0,
    )


class ReplicaMonitor:
    """Polls the running replica count of each phase in the background."""

    def __init__(self, app: str, period_s: float = 0.25) -> None:
        self.app = app
        self.period_s = period_s
        self.samples: list[tuple[float, int, int]] = []  # (t, prefill, decode)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _counts(self) -> tuple[int, int]:
        deps = serve.status().applications[self.app].deployments
        return tuple(  # type: ignore[return-value]
            int(deps[name].replica_states.get("RUNNING", 0))
            for name in ("PrefillServer", "DecodeServer"))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                prefill, decode = self._counts()
                self.samples.append((time.monotonic(), prefill, decode))
            except Exception:  # a status call racing a deploy: try again next period
                pass
            self._stop.wait(self.period_s)

    def start(self) -> ReplicaMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def transitions(self, t0: float = 0.0) -> list[tuple[float, int, int]]:
        """(seconds since t0, prefill, decode) at each change of the counts."""
        out: list[tuple[float, int, int]] = []
        for t, p, d in self.samples:
            if not out or out[-1][1:] != (p, d):
                out.append((round(t - t0, 1), p, d))
        return out

    def latest(self) -> tuple[int, int]:
        return self.samples[-1][1:] if self.samples else (0, 0)

    def since(self, t0: float) -> list[tuple[float, int, int]]:
        return [s for s in self.samples if s[0] >= t0]

    def wait_for(self, check: Callable[[int, int], bool], timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.samples and check(*self.latest()):
                return self.samples[-1][0]
            time.sleep(self.period_s)
        raise TimeoutError(f"replicas (prefill, decode) still {self.latest()} "
                           f"after {timeout_s}s")


@dataclass
class StreamResult:
    status: int
    started: float
    ended: float = 0.0
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: Any = None
    done: bool = False  # saw data: [DONE]
    chunk_times: list[float] = field(default_factory=list)


async def _completion_stream(client: httpx.AsyncClient, url: str,
                             body: dict[str, Any]) -> StreamResult:
    res = StreamResult(status=0, started=time.monotonic())
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        res.status = r.status_code
        if r.status_code != 200:
            res.error = (await r.aread()).decode()
        else:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    res.done = True
                    break
                obj = json.loads(data)
                if obj.get("choices"):
                    res.chunk_times.append(time.monotonic())
                if "error" in obj:
                    res.error = obj["error"]
                for choice in obj.get("choices", []):
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
                if obj.get("usage"):
                    res.completion_tokens = obj["usage"]["completion_tokens"]
    res.ended = time.monotonic()
    return res


async def _completion(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamResult:
    res = StreamResult(status=0, started=time.monotonic())
    r = await client.post(f"{url}/v1/completions", json=body)
    res.status, res.ended = r.status_code, time.monotonic()
    if r.status_code == 200:
        out = r.json()
        res.completion_tokens = out["usage"]["completion_tokens"]
        res.finish_reason = out["choices"][0]["finish_reason"]
        res.done = True
    else:
        res.error = r.text
    return res


@dataclass
class Load:
    """Closed-loop load: ``concurrency`` workers, each sending one request after another
    until ``stop`` is set (or ``max_s`` passes). With ``cancel_on_stop`` the requests still
    running then are dropped by the client (their connections closed) instead of awaited."""

    url: str
    body: Callable[[int], dict[str, Any]]
    concurrency: int
    streaming: bool
    cancel_on_stop: bool = False
    results: list[StreamResult] = field(default_factory=list)
    cancelled: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    async def _stopped(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(0.05)

    async def run(self, max_s: float) -> list[StreamResult]:
        deadline = time.monotonic() + max_s
        call = _completion_stream if self.streaming else _completion
        async with httpx.AsyncClient(timeout=300) as client:
            async def worker(i: int) -> None:
                n = 0
                while not self.stop.is_set() and time.monotonic() < deadline:
                    request = asyncio.create_task(call(client, self.url, self.body(i * 1000 + n)))
                    n += 1
                    if not self.cancel_on_stop:
                        self.results.append(await request)
                        continue
                    stopped = asyncio.create_task(self._stopped())
                    await asyncio.wait({request, stopped}, return_when=asyncio.FIRST_COMPLETED)
                    if request.done():
                        stopped.cancel()
                        self.results.append(request.result())
                    else:
                        request.cancel()
                        self.cancelled += 1
                        with contextlib.suppress(asyncio.CancelledError):
                            await request
            await asyncio.gather(*(worker(i) for i in range(self.concurrency)))
        return self.results

    def run_in_thread(self, max_s: float) -> threading.Thread:
        t = threading.Thread(target=lambda: asyncio.run(self.run(max_s)), daemon=True)
        t.start()
        return t


def _prompt_ids(n: int, salt: int) -> list[int]:
    # ordinary-token ids, different per request so nothing could be cached
    return [1000 + (salt * 7919 + i * 31) % 20000 for i in range(n)]


@pytest.fixture(scope="module")
def autoscale_app(split_cluster):
    from deployments.builder import build_app

    # Apps that other modules left running hold replica slots this module scales into. Only
    # the session's split app is shared with later modules: it comes back afterwards.
    running = list(serve.status().applications)
    had_split_app = APP in running
    for name in running:
        serve.delete(name)
    serve.run(build_app(autoscale_args()), name=AS_APP, route_prefix=ROUTE, blocking=False)
    url = f"{split_cluster.url}{ROUTE}"
    wait_ready(url)
    monitor = ReplicaMonitor(AS_APP).start()
    monitor.wait_for(lambda p, d: (p, d) == (1, 1), 30)
    try:
        yield url, monitor
    finally:
        monitor.stop()
        serve.delete(AS_APP)
        if had_split_app:
            serve.run(build_app(split_app_args()), name=APP, route_prefix="/", blocking=False)
            wait_ready(split_cluster.url)


def test_prefill_heavy_load_scales_prefill_only(autoscale_app):
    url, monitor = autoscale_app
    t0 = time.monotonic()
    # long prompts, one output token: all prefill, no decode
    load = Load(url, lambda i: {"prompt": _prompt_ids(1024, i), "max_tokens": 1,
                                "temperature": 0}, concurrency=3, streaming=False)
    thread = load.run_in_thread(max_s=120)
    try:
        monitor.wait_for(lambda p, d: p == 2, timeout_s=90)
    finally:
        load.stop.set()
        thread.join(timeout=120)
    t_min = monitor.wait_for(lambda p, d: p == 1, timeout_s=60)
    time.sleep(3)
    print(f"prefill-heavy (s, prefill, decode): {monitor.transitions(t0)}; "
          f"{len(load.results)} requests")
    during = monitor.since(t0)
    assert max(p for _, p, _ in during) == 2
    assert {d for _, _, d in during} == {1}, "decode must not scale on prefill load"
    assert load.results and all(r.status == 200 and r.completion_tokens == 1
                                for r in load.results)
    # back at the minimum, and it stays there while idle
    assert {s[1:] for s in monitor.since(t_min)} == {(1, 1)}


def _idle_token_s(url: str) -> float:
    """Median time between tokens of a lone stream: how fast a tail stream will run at best
    (it runs beside at most one other stream)."""
    res = asyncio.run(_one_stream(url, {"prompt": _prompt_ids(LOCAL_THRESHOLD + 8, 0),
                                        "max_tokens": 40, "ignore_eos": True,
                                        "temperature": 0}))
    gaps = [b - a for a, b in zip(res.chunk_times[1:], res.chunk_times[2:], strict=False)]
    return statistics.median(gaps)


async def _one_stream(url: str, body: dict[str, Any]) -> StreamResult:
    async with httpx.AsyncClient(timeout=300) as client:
        return await _completion_stream(client, url, body)


def test_decode_heavy_load_scales_decode_only_and_scaling_down_cuts_no_stream(autoscale_app):
    url, monitor = autoscale_app
    # Tail streams must outlast the scale-down (~the look-back plus the downscale delay plus
    # a metrics push after the heavy load is dropped): ~30 s at the best pace a lone stream
    # gets here, whatever this machine's speed.
    token_s = _idle_token_s(url)
    tail_tokens = int(min(1500, max(150, 30.0 / token_s)))
    t0 = time.monotonic()
    # short prompts (over the local threshold, so they hop through prefill), outputs long
    # enough to keep the batch full yet short enough that streams finish while the load lasts
    # (~4 s of lone-stream pace, a few times that in the full batch), three times the streams
    # one decode replica should hold
    heavy_tokens = int(min(48, max(8, 4.0 / token_s)))
    heavy = Load(url, lambda i: {"prompt": _prompt_ids(LOCAL_THRESHOLD + 8, i),
                                 "max_tokens": heavy_tokens, "ignore_eos": True,
                                 "temperature": 0},
                 concurrency=3 * SEQUENCES_PER_DECODE_REPLICA, streaming=True,
                 cancel_on_stop=True)
    heavy_thread = heavy.run_in_thread(max_s=150)
    try:
        monitor.wait_for(lambda p, d: d == 2, timeout_s=90)
    except TimeoutError:
        heavy.stop.set()
        raise
    # One long stream pinned to each decode replica (FeedRouter's on_replica): whichever
    # one Serve removes once the load is gone, a stream is running on it. (Left to the
    # router, both could land on one replica: its view of their queues is seconds old.)
    decode = serve.get_deployment_handle("DecodeServer", AS_APP)
    pinned = sorted(decode_replica_stats(AS_APP))  # each asked by its id
    assert len(pinned) == 2, pinned

    def tail(rid: str) -> tuple[str, list[Any], float]:
        req = PrefillRequest(f"tail-{rid}", tuple(_prompt_ids(LOCAL_THRESHOLD + 8, 99)),
                             SamplingParams(max_tokens=tail_tokens, ignore_eos=True,
                                            temperature=0.0))
        items = list(decode.options(stream=True).generate_local.remote(req, on_replica=rid))
        return items[0].replica_id, items[1:], time.monotonic()

    with ThreadPoolExecutor(2) as pool:
        tails = [pool.submit(tail, rid) for rid in pinned]
        time.sleep(0.5)
        heavy.stop.set()  # the heavy clients go away at once, their streams with them
        heavy_thread.join(timeout=60)
        t_down = monitor.wait_for(lambda p, d: d == 1, timeout_s=120)
        done = [f.result(timeout=600) for f in tails]
    monitor.wait_for(lambda p, d: (p, d) == (1, 1), timeout_s=60)
    print(f"decode-heavy (s, prefill, decode): {monitor.transitions(t0)}; "
          f"{len(heavy.results)} streams done, {heavy.cancelled} dropped by the client; "
          f"{token_s * 1000:.0f} ms/token alone; tails of {tail_tokens} tokens; down at "
          f"{t_down - t0:.1f}s, tails ended at {[round(e - t0, 1) for _, _, e in done]}")

    during = monitor.since(t0)
    assert max(d for _, _, d in during) == 2
    assert {p for _, p, _ in during} == {1}, "prefill must not scale on decode load"
    # every heavy stream the client waited for ended normally with all of its tokens
    assert heavy.results
    for r in heavy.results:
        assert (r.status, r.error, r.done) == (200, None, True)
        assert (r.completion_tokens, r.finish_reason) == (heavy_tokens, "length")
    assert [landed for landed, _, _ in done] == pinned
    for _, events, _ in done:
        assert [e.index for e in events] == list(range(tail_tokens))
        assert all(e.error is None for e in events)
        assert events[-1].finish_reason == "length"
    # The replica that went away was streaming when it left the running set, and its
    # stream still ended with all of its tokens: it drained instead of being cut.
    survivor = {decode.stats.remote().result(timeout_s=60)["replica_id"] for _ in range(3)}
    assert len(survivor) == 1 and survivor <= set(pinned)
    drained = [ended for landed, _, ended in done if landed not in survivor]
    assert len(drained) == 1
    assert drained[0] > t_down
    assert monitor.latest() == (1, 1)


HTTP_PROMPTS = ("Hi", "Tell me about the ocean. " * 8)  # under and over the threshold


@pytest.fixture(scope="module")
def reference(smollm_model, smollm_tokenizer) -> list[str]:
    """Greedy completions of HTTP_PROMPTS from the in-process engine."""
    engine = LocalEngine(EngineConfig(), model=smollm_model, tokenizer=smollm_tokenizer)

    async def run() -> list[str]:
        outs = []
        for text in HTTP_PROMPTS:
            req = engine.make_request(SamplingParams(max_tokens=16, temperature=0.0),
                                      prompt=text)
            outs.append((await engine.generate(req)).text)
        await engine.close()
        return outs

    return asyncio.run(run())


def test_greedy_tokens_identical_prefilled_locally_or_remotely(autoscale_app, reference):
    from app.messages import StreamStart

    url, _ = autoscale_app
    prefill = serve.get_deployment_handle("PrefillServer", AS_APP)
    decode = serve.get_deployment_handle("DecodeServer", AS_APP)

    def tokens(stream) -> tuple[list[int], StreamStart]:
        items = list(stream)
        assert isinstance(items[0], StreamStart)
        return [e.token_id for e in items[1:]], items[0]

    for n in (5, LOCAL_THRESHOLD - 1, 200):
        req = PrefillRequest(f"same-{n}", tuple(_prompt_ids(n, n)),
                             SamplingParams(max_tokens=20, temperature=0.0))
        ref = prefill.make_kv_package.remote(req)._to_object_ref_sync()
        remote, s_remote = tokens(decode.options(stream=True).generate.remote([ref]))
        local, s_local = tokens(decode.options(stream=True).generate_local.remote(req))
        assert s_local.local_prefill and not s_remote.local_prefill
        assert len(remote) == 20 and local == remote

    # through the HTTP API: routed by length, both equal the in-process engine
    handle = serve.get_app_handle(AS_APP)
    paths = []
    for text, expected in zip(HTTP_PROMPTS, reference, strict=True):
        body = {"prompt": text, "max_tokens": 16, "temperature": 0}
        trace = handle.trace.remote(body, kind="completion").result(timeout_s=120)
        prompt_tokens = trace["response"]["usage"]["prompt_tokens"]
        assert trace["prefill_path"] == ("local" if prompt_tokens < LOCAL_THRESHOLD
                                         else "remote")
        paths.append(trace["prefill_path"])
        assert trace["response"]["choices"][0]["text"] == expected
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
    assert paths == ["local", "remote"]
