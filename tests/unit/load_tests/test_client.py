"""The streaming client and the run loop against a fake OpenAI server (httpx MockTransport):
the SSE reader, TTFT/ITL timing, usage, failures, and the request and time bounds."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from load_tests.client import is_local_url, iter_sse_events, send_streaming, sse_events
from load_tests.loadgen import LoadPlan, Stream, _parse_args, run_load
from load_tests.workloads import LengthDist, RequestClass, RequestSpec

GAP = 0.05


def fake_server(*, first_delay: float = 0.1, gap: float = GAP, status: int = 200,
                usage: bool = True, error_after: int | None = None, log: list | None = None):
    """A /v1/completions stream: an empty role-like chunk, then max_tokens one-token chunks
    ``gap`` apart after ``first_delay``, then a usage chunk and [DONE]."""

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if log is not None:
            log.append((time.perf_counter(), body))
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "queue full",
                                                          "type": "overloaded"}})
        n = body["max_tokens"]

        async def sse():
            yield b'data: {"choices": [{"text": ""}]}\n\n'
            await asyncio.sleep(first_delay)
            for i in range(n):
                if i:
                    await asyncio.sleep(gap)
                if error_after is not None and i == error_after:
                    yield b'data: {"error": {"message": "boom", "type": "server_error"}}\n\n'
                    break
                yield f'data: {json.dumps({"choices": [{"text": f"t{i}"}]})}\n\n'.encode()
            if usage:
                u = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
                yield f'data: {json.dumps({"choices": [], "usage": u})}\n\n'.encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=sse())

    return httpx.MockTransport(handler)


SSE_BODY = (b": keep-alive comment\n\nevent: message\ndata: {\"a\": 1}\n\n"
            b"data:{\"b\": [2]}\n\n\ndata: [DONE]\n\ndata: {\"after\": 3}\n\n")


def _sse_transport(content: bytes) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=content))


async def test_sse_events_yields_data_chunks_until_done():
    async with httpx.AsyncClient(transport=_sse_transport(SSE_BODY)) as client:
        async with client.stream("POST", "http://127.0.0.1/v1/completions") as resp:
            chunks = [c async for c in sse_events(resp)]
    # comments, event: lines and blank separators carry no chunk; nothing after [DONE]
    assert chunks == [{"a": 1}, {"b": [2]}]


def test_iter_sse_events_reads_a_sync_response_the_same_way():
    with httpx.Client(transport=_sse_transport(SSE_BODY)) as client:
        with client.stream("POST", "http://127.0.0.1/v1/completions") as resp:
            assert list(iter_sse_events(resp)) == [{"a": 1}, {"b": [2]}]
    with httpx.Client(transport=_sse_transport(b"data: {not json}\n\n")) as client:
        with client.stream("POST", "http://127.0.0.1/v1/completions") as resp:
            with pytest.raises(ValueError):
                list(iter_sse_events(resp))


async def _one(transport, **body) -> object:
    async with httpx.AsyncClient(transport=transport) as client:
        body = {"prompt": [1, 2, 3], "max_tokens": 5, **body}
        return await send_streaming(client, "http://127.0.0.1/v1/completions", body,
                                    "completions", "c", time.perf_counter())


async def test_stream_timing_usage_and_itl():
    rec = await _one(fake_server(first_delay=0.15, gap=GAP), max_tokens=5)
    assert rec.ok and rec.error is None
    assert rec.output_tokens == 5 and rec.prompt_tokens == 3
    assert rec.ttft_s >= 0.15  # the empty first chunk does not count
    assert len(rec.itl_s) == 4 and all(GAP * 0.9 <= g < GAP + 0.25 for g in rec.itl_s)
    assert rec.e2e_s >= rec.ttft_s + 4 * GAP * 0.9
    assert rec.tpot_s == pytest.approx((rec.e2e_s - rec.ttft_s) / 4)


async def test_output_tokens_fall_back_to_chunks_without_usage():
    rec = await _one(fake_server(usage=False, first_delay=0.0, gap=0.0), max_tokens=7)
    assert rec.ok and rec.output_tokens == 7


async def test_http_error_and_stream_error_are_failures_with_messages():
    rec = await _one(fake_server(status=429))
    assert not rec.ok and rec.error == "HTTP 429: overloaded: queue full"
    rec = await _one(fake_server(error_after=2, first_delay=0.0, gap=0.0))
    assert not rec.ok and rec.error == "stream error: server_error: boom"


def _plan(streams, duration=30.0, drain=10.0) -> LoadPlan:
    return LoadPlan("http://127.0.0.1:1", "completions", streams, duration, drain)


def _maker(cls: RequestClass, rng: random.Random) -> RequestSpec:
    n = cls.input_len.sample(rng)
    return RequestSpec(cls.name, cls.output_len.sample(rng), cls.ignore_eos,
                       prompt=[7] * n, input_tokens=n)


async def test_closed_loop_keeps_concurrency_and_bounds_requests():
    log: list = []
    a = RequestClass("a", LengthDist.fixed(4), LengthDist.fixed(3))
    plan = _plan([Stream("shared", [a], num_requests=6, concurrency=2)])
    res = await run_load(plan, _maker, progress=False,
                         transport=fake_server(first_delay=0.05, gap=0.02, log=log))
    assert len(res.records) == 6 == len(log)
    assert all(r.ok and r.output_tokens == 3 and r.prompt_tokens == 4 for r in res.records)
    # two clients: requests go out in pairs, each pair after the previous one finished
    starts = sorted(r.sent_at for r in res.records)
    assert starts[1] - starts[0] < 0.03 and starts[2] - starts[1] > 0.05
    assert all(body["ignore_eos"] and body["stream"] for _, body in log)


async def test_per_class_streams_background_and_time_bound():
    docs = RequestClass("docs", LengthDist.fixed(32), LengthDist.fixed(2), rate=20.0,
                        num_requests=3)
    decode = RequestClass("decode", LengthDist.fixed(4), LengthDist.fixed(4), concurrency=2,
                          num_requests=1000, background=True)
    plan = _plan([Stream("docs", [docs], 3, rate=20.0),
                  Stream("decode", [decode], 1000, concurrency=2, background=True)])
    res = await run_load(plan, _maker, progress=False,
                         transport=fake_server(first_delay=0.02, gap=0.02))
    by = {c: [r for r in res.records if r.request_class == c] for c in ("docs", "decode")}
    assert len(by["docs"]) == 3
    # background decode streams stop once the docs are done, far short of their bound
    assert 2 <= len(by["decode"]) < 40
    assert all(r.ok for r in res.records)
    last_doc_done = max(r.finished_at for r in by["docs"])
    assert all(r.sent_at <= last_doc_done + 0.01 for r in by["decode"])

    # a run that would take 100 x 0.5 s stops issuing at 0.3 s and cuts the drain at 0.2 s
    slow = RequestClass("slow", LengthDist.fixed(2), LengthDist.fixed(50))
    plan = _plan([Stream("shared", [slow], 100, rate=50.0)], duration=0.3, drain=0.2)
    t0 = time.perf_counter()
    res = await run_load(plan, _maker, progress=False,
                         transport=fake_server(first_delay=0.01, gap=0.01))
    assert time.perf_counter() - t0 < 1.5
    assert 3 <= len(res.records) < 40
    assert all(not r.ok and "time limit" in r.error for r in res.records)


def test_remote_hosts_are_refused_without_the_flag(capsys):
    assert is_local_url("http://127.0.0.1:8000") and is_local_url("http://localhost:1")
    assert is_local_url("http://[::1]:8000") and is_local_url("http://127.0.0.2:8000")
    assert not is_local_url("http://10.0.0.5:8000") and not is_local_url("https://api.x.com")
    with pytest.raises(SystemExit):
        _parse_args(["--base-url", "http://10.0.0.5:8000", "--rate", "1"])
    assert "--allow-remote" in capsys.readouterr().err
    args = _parse_args(["--base-url", "http://10.0.0.5:8000", "--allow-remote", "--rate", "1"])
    assert args.allow_remote


def test_each_run_of_a_rate_sweep_sends_prompts_of_its_own():
    """A prefix-caching server must not see a later rate's prompts again: every run of a
    sweep draws its prompts from its own seed, and the first run keeps the given seed."""
    from dataclasses import replace

    from load_tests.loadgen import _build_specs, sweep_seed

    a = RequestClass("a", LengthDist.parse("uniform:4:64"), LengthDist.fixed(3))
    plan = _plan([Stream("shared", [a], num_requests=20, rate=1.0)])

    def drawn(seed: int) -> list[int]:
        [specs] = _build_specs(replace(plan, seed=seed), _maker)
        return [s.input_tokens for s in specs]

    runs = [drawn(sweep_seed(5, k)) for k in range(3)]
    assert runs[0] == drawn(5)
    assert runs[0] != runs[1] and runs[1] != runs[2] and runs[0] != runs[2]


async def test_warmup_requests_send_prompts_of_their_own():
    """``--warmup``: unmeasured requests first, whose prompts are none of the measured ones
    (the measured requests' first prompts found in the server's prefix cache would make
    their TTFT a cache hit's: the planner's validation runs once measured 80 ms for a
    256-token prompt that takes 320 ms)."""
    log: list = []
    a = RequestClass("a", LengthDist.parse("uniform:8:64"), LengthDist.fixed(2))

    def maker(cls: RequestClass, rng: random.Random) -> RequestSpec:
        n = cls.input_len.sample(rng)
        return RequestSpec(cls.name, cls.output_len.sample(rng), cls.ignore_eos,
                           prompt=[rng.randrange(1000) for _ in range(n)], input_tokens=n)

    plan = _plan([Stream("s", [a], num_requests=4, concurrency=1)])
    res = await run_load(plan, maker, progress=False, warmup=2,
                         transport=fake_server(first_delay=0.001, gap=0.001, log=log))
    assert len(res.records) == 4 and len(log) == 6
    warm, measured = [b["prompt"] for _, b in log[:2]], [b["prompt"] for _, b in log[2:]]
    assert not any(w == m for w in warm for m in measured)
    # the measured prompts are still the plan's (the same with or without a warm-up)
    log2: list = []
    await run_load(plan, maker, progress=False,
                   transport=fake_server(first_delay=0.001, gap=0.001, log=log2))
    assert [b["prompt"] for _, b in log2] == measured
