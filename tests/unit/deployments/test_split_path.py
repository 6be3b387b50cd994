"""The split path on fake phase handles (no Ray cluster): the hop (prefill -> ref -> decode),
local prefill, and the failure policy: resume after a lost replica with no missing or
duplicated token, a bounded retry budget, a request timeout, and no retry for errors that a
retry cannot fix."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import ray

from app.errors import QueueFullError, RequestTimeoutError
from app.messages import FinishReason, PrefillRequest, StreamStart, TokenEvent
from app.output import GenerationFailed
from app.sampling import SamplingParams
from deployments.kv_budget import KVBudget
from deployments.request_trace import RequestTrace
from deployments.retries import choice_request, is_retryable
from deployments.split_path import SplitPath

TOKENS = list(range(100, 112))


class FakeCall:
    """What a Serve handle call returns: awaitable as a ref, async-iterable as a stream."""

    def __init__(self, value: Any = None, stream: AsyncIterator[Any] | None = None) -> None:
        self.value = value
        self.stream = stream
        self.cancelled = False

    async def _to_object_ref(self) -> Any:
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value

    def __aiter__(self) -> AsyncIterator[Any]:
        assert self.stream is not None
        return self.stream

    def __await__(self):
        return self._to_object_ref().__await__()

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """``handle.options(...).method.remote(*args)`` calls ``methods[method](*args)``."""

    def __init__(self, **methods: Callable[..., FakeCall]) -> None:
        self.methods = methods
        self.calls: list[tuple[str, tuple]] = []
        self.kwargs: list[dict[str, Any]] = []

    def options(self, **_: Any) -> FakeHandle:
        return self

    def __getattr__(self, name: str) -> Any:
        handle = self

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> FakeCall:
                if name == "ping" and "ping" not in handle.methods:
                    return FakeCall(value="node")  # a live replica answers (not recorded)
                handle.calls.append((name, args))
                handle.kwargs.append(kwargs)  # the ingress's token feed id, when it has one
                return handle.methods[name](*args)

        return _Method


def start() -> StreamStart:
    return StreamStart("decode-node", 10, kv_hop_s=0.01, fetch_s=0.0, prefill_s=0.1)


def token_stream(preq: PrefillRequest, fail_at: int | None = None) -> AsyncIterator[Any]:
    async def gen():
        yield start()
        for i, tok in enumerate(TOKENS[preq.output_offset:], preq.output_offset):
            if i == fail_at:
                raise ray.exceptions.ActorDiedError()
            last = i == len(TOKENS) - 1
            yield TokenEvent(preq.request_id, tok, i, FinishReason.LENGTH if last else None)
    return gen()


def split_path(prefill: FakeHandle | None, decode: FakeHandle, **kw: Any) -> SplitPath:
    opts = {"local_prefill_threshold": 0, "request_timeout_s": 30.0, "max_retries": 2,
            "retry_backoff_s": 0.01, "locate": lambda ref: (["prefill-node"], 123), **kw}
    return SplitPath(prefill, decode, **opts)


def request(max_tokens: int = len(TOKENS)) -> PrefillRequest:
    return PrefillRequest("req", (1, 2, 3), SamplingParams(max_tokens=max_tokens,
                                                           temperature=0.0))


def run(path: SplitPath, preq: PrefillRequest, trace: RequestTrace | None = None
        ) -> list[TokenEvent]:
    async def collect():
        return [ev async for ev in path.resumable_stream(preq, trace or RequestTrace())]
    return asyncio.run(collect())


def gated_stream(gate: asyncio.Event,
                 gated: Callable[[PrefillRequest], bool] = lambda preq: True,
                 ) -> Callable[[PrefillRequest], AsyncIterator[Any]]:
    """A stream maker whose streams (those ``gated`` picks) start once ``gate`` is set: a
    prefill or decode that has not started yet."""
    def make(preq: PrefillRequest) -> AsyncIterator[Any]:
        async def gen():
            if gated(preq):
                await gate.wait()
            async for item in token_stream(preq):
                yield item
        return gen()
    return make


def hop_handles(decode_stream: Callable[[PrefillRequest], AsyncIterator[Any]]
                ) -> tuple[FakeHandle, FakeHandle]:
    """A prefill handle whose refs are the requests themselves, and a decode handle that
    streams ``decode_stream(request)`` for the ref it is given."""
    prefill = FakeHandle(make_kv_package=lambda preq: FakeCall(value=preq))
    decode = FakeHandle(generate=lambda wrapped: FakeCall(stream=decode_stream(wrapped[0])))
    return prefill, decode


def test_the_hop_hands_decode_the_ref_not_the_package():
    prefill, decode = hop_handles(token_stream)
    trace = RequestTrace()
    out = run(split_path(prefill, decode), request(), trace)
    assert [e.token_id for e in out] == TOKENS
    [(name, (preq,))] = prefill.calls
    assert name == "make_kv_package" and preq.request_id == "req"
    [(name, (wrapped,))] = decode.calls
    # the ref travels inside a list, so Ray does not resolve it in the ingress; decode
    # resolves it on its own node
    assert name == "generate" and isinstance(wrapped, list) and wrapped[0] is preq
    assert trace.attempts == 1 and trace.stream_start == start()
    assert trace.kv_locations == ["prefill-node"] and trace.kv_object_size == 123


def test_short_prompts_and_the_colocated_app_prefill_on_the_decode_replica():
    decode = FakeHandle(generate_local=lambda preq: FakeCall(stream=token_stream(preq)))
    prefill = FakeHandle()
    out = run(split_path(prefill, decode, local_prefill_threshold=4), request())
    assert [e.token_id for e in out] == TOKENS and prefill.calls == []
    assert [c[0] for c in decode.calls] == ["generate_local"]
    out = run(split_path(None, decode), request())
    assert [e.token_id for e in out] == TOKENS


def test_a_client_that_leaves_during_prefill_drops_the_queued_prompt():
    never = asyncio.Event()
    calls: list[FakeCall] = []

    class SlowCall(FakeCall):
        async def _to_object_ref(self) -> Any:
            await never.wait()

    def slow_prefill(preq):
        calls.append(SlowCall())
        return calls[-1]

    path = split_path(FakeHandle(make_kv_package=slow_prefill), FakeHandle())

    async def leave_early():
        task = asyncio.ensure_future(
            path.prefill_then_decode(request(), RequestTrace()).__anext__())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave_early())
    assert calls[0].cancelled


def test_resume_after_a_lost_decode_replica_continues_the_stream():
    seen: list[PrefillRequest] = []

    def stream(preq):
        seen.append(preq)
        return token_stream(preq, fail_at=5 if len(seen) == 1 else None)

    path = split_path(*hop_handles(stream))
    trace = RequestTrace()
    out = run(path, request(), trace)
    assert [e.token_id for e in out] == TOKENS  # none missing, none twice
    assert [e.index for e in out] == list(range(len(TOKENS)))
    retry = seen[1]
    assert retry.prompt_token_ids == (1, 2, 3, *TOKENS[:5])  # prompt + what was sent
    assert retry.output_offset == 5
    assert retry.sampling.max_tokens == len(TOKENS) - 5
    assert path.retries == 1 and trace.attempts == 2


def test_lost_kv_object_before_any_token_reruns_prefill():
    refs = [ray.exceptions.OwnerDiedError("0" * 56, None, "")]

    def make(preq):
        return FakeCall(value=refs.pop() if refs else preq)

    prefill = FakeHandle(make_kv_package=make)
    decode = FakeHandle(generate=lambda wrapped: FakeCall(stream=token_stream(wrapped[0])))
    out = run(split_path(prefill, decode), request())
    assert [e.token_id for e in out] == TOKENS and len(prefill.calls) == 2


def test_retry_budget_runs_out_with_a_clean_error_in_bounded_time():
    def stream(preq):
        return token_stream(preq, fail_at=preq.output_offset + 1)

    prefill, decode = hop_handles(stream)
    t = time.perf_counter()
    with pytest.raises(GenerationFailed, match="after 2 retries"):
        run(split_path(prefill, decode, max_retries=2), request())
    assert len(prefill.calls) == 3 and time.perf_counter() - t < 2.0


def test_errors_a_retry_cannot_fix_are_not_retried():
    prefill = FakeHandle(make_kv_package=lambda preq: FakeCall(value=QueueFullError("full")))
    with pytest.raises(QueueFullError):
        run(split_path(prefill, FakeHandle()), request())
    assert len(prefill.calls) == 1
    assert not is_retryable(QueueFullError("x")) and not is_retryable(ValueError())
    assert is_retryable(ray.exceptions.ActorDiedError())
    assert is_retryable(ray.exceptions.ObjectLostError("0" * 56, None, ""))


def test_request_timeout_ends_a_stuck_stream_and_closes_it():
    closed = asyncio.Event()

    async def stuck(preq):
        try:
            yield start()
            yield TokenEvent(preq.request_id, TOKENS[0], 0)
            await asyncio.sleep(3600)
        finally:
            closed.set()

    async def go():
        path = split_path(*hop_handles(stuck), request_timeout_s=0.3)
        t = time.perf_counter()
        with pytest.raises(RequestTimeoutError):
            async for _ in path.resumable_stream(request(), RequestTrace()):
                pass
        return time.perf_counter() - t, closed.is_set()

    elapsed, was_closed = asyncio.run(go())
    assert 0.25 <= elapsed < 2.0 and was_closed


def test_readiness_pings_each_phase():
    async def ok():
        return "node"

    async def dead():
        raise ray.exceptions.ActorDiedError()

    up = FakeHandle(ping=lambda: ok())
    down = FakeHandle(ping=lambda: dead())
    assert asyncio.run(split_path(up, up).readiness(1.0)) == {
        "ready": True, "prefill": True, "decode": True}
    assert asyncio.run(split_path(up, down).readiness(1.0))["ready"] is False
    assert asyncio.run(split_path(None, up).readiness(1.0)) == {"ready": True,
                                                                 "colocated": True}


def test_n_answers_share_one_prefill_and_a_lost_answer_resumes_alone():
    """n = 3: one make_kv_package call; every answer's first stream reads that ref with its
    own choice; an answer whose decode replica dies re-prefills as its own request."""
    def decode_stream(wrapped, choice=None):
        base = wrapped[0]  # the ref: the request made for all answers, or a retry's own
        preq = base if choice is None else choice_request(base, choice)
        return token_stream(preq, fail_at=5 if choice == 1 else None)

    prefill = FakeHandle(make_kv_package=lambda preq: FakeCall(value=preq))
    decode = FakeHandle(generate=lambda wrapped, choice=None: FakeCall(
        stream=decode_stream(wrapped, choice)))
    path = split_path(prefill, decode)
    preq = PrefillRequest("req", (1, 2, 3), SamplingParams(max_tokens=len(TOKENS),
                                                           temperature=1.0, seed=7), n=3)

    async def all_answers():
        shared = await path.shared_prefill(preq)
        assert shared.ref is preq
        streams = [path.resumable_stream(choice_request(preq, k), RequestTrace(), (shared, k))
                   for k in range(3)]
        answers = []
        for stream in streams:
            answers.append([e.token_id async for e in stream])
        return answers

    answers = asyncio.run(all_answers())
    assert answers == [TOKENS] * 3  # answer 1 resumed with nothing missing or repeated
    made = [args[0] for name, args in prefill.calls]
    # the shared prefill, then answer 1's retry: its own id and seed, prompt + 5 tokens
    assert [m.request_id for m in made] == ["req", "req/1-retry1"]
    assert made[1].sampling.seed == 8 and made[1].output_offset == 5
    # answers run one after the other here: 0, 1 (dies), 1's retry (no choice), 2
    assert [args[1:] for name, args in decode.calls] == [(0,), (1,), (), (2,)]


@pytest.mark.parametrize("colocated", [True, False])
def test_n_answers_on_the_local_path_share_one_prefill_on_the_decode_side(colocated):
    """The colocated app, and a prompt under local_prefill_threshold: the decode side makes
    the one package (make_kv_package) and each answer's stream reads it with its choice;
    the prefill phase is never called. The answers' traces say the prefill was local, and
    in the split app the package (in the decode node's object store) holds its room in the
    KV budget until the caller releases it."""
    decode = FakeHandle(
        make_kv_package=lambda preq: FakeCall(value=preq),
        generate=lambda wrapped, choice=None: FakeCall(
            stream=token_stream(choice_request(wrapped[0], choice))))
    prefill = None if colocated else FakeHandle()
    budget = None if colocated else KVBudget(10_000)
    path = split_path(prefill, decode, local_prefill_threshold=0 if colocated else 4,
                      kv_budget=budget, kv_bytes_per_token=100)
    preq = PrefillRequest("req", (1, 2, 3), SamplingParams(max_tokens=4, seed=1), n=2)
    traces = [RequestTrace(), RequestTrace()]

    async def all_answers():
        shared = await path.shared_prefill(preq)
        assert shared.ref is preq and shared.local
        if budget is not None:
            assert budget.used == 300  # 3 prompt tokens x 100 bytes
        answers = []
        for k in range(2):
            stream = path.resumable_stream(choice_request(preq, k), traces[k], (shared, k))
            answers.append([e.token_id async for e in stream])
        shared.reservation.release()
        return answers

    assert asyncio.run(all_answers()) == [TOKENS] * 2
    assert [t.as_dict()["prefill_path"] for t in traces] == ["local", "local"]
    assert budget is None or budget.used == 0
    assert [(name, args[1:]) for name, args in decode.calls] == [
        ("make_kv_package", ()), ("generate", (0,)), ("generate", (1,))]
    assert prefill is None or prefill.calls == []


@pytest.mark.parametrize(("temperature", "presence", "frequency"),
                         [(0.0, 2.0, 2.0), (0.9, -2.0, -1.0)])
def test_a_resumed_stream_keeps_its_penalties_min_tokens_and_logprobs(
        temperature, presence, frequency):
    """A lost decode replica mid-stream: the retry SplitPath builds (prompt + delivered tokens,
    output_offset) continues the penalized stream exactly, because the penalties count the
    delivered tokens as output and min_tokens counts the stream's index. Also: the stream is
    the same when it shares its batch with others. A model with flat logits over a small
    vocabulary, so the penalties decide tokens (greedy alone repeats one token)."""
    from app.config import EngineConfig
    from app.engine_core import EngineCore
    from tests.conftest import make_tiny_model

    core = EngineCore(EngineConfig(), model=make_tiny_model(vocab_size=512,
                                                            initializer_range=0.02))
    eos = frozenset({2})
    prefiller = core.make_prefiller(eos)
    sp = SamplingParams(max_tokens=14, temperature=temperature, seed=5,
                        presence_penalty=presence, frequency_penalty=frequency, min_tokens=10,
                        logprobs=1)
    preq = PrefillRequest("pen", tuple(range(300, 320)), sp)

    async def scenario():
        loop = core.make_decode_loop(eos)

        async def whole(req: PrefillRequest, crowd: int = 0) -> list[TokenEvent]:
            others = [PrefillRequest(f"o{i}", tuple(range(400 + i, 430)),
                                     SamplingParams(max_tokens=14, temperature=1.0, seed=i))
                      for i in range(crowd)]
            async def events(pkg):
                return [ev async for ev in loop.generate(pkg)]

            pkgs = prefiller.make_packages([req, *others])
            return (await asyncio.gather(*(events(p) for p in pkgs)))[0]

        seen: list[PrefillRequest] = []

        def local(req: PrefillRequest) -> FakeCall:
            seen.append(req)
            fail = len(seen) == 1

            async def gen():
                yield start()
                [pkg] = prefiller.make_packages([req])
                async for ev in loop.generate(pkg):
                    if fail and ev.index == 6:
                        raise ray.exceptions.ActorDiedError()
                    yield ev
            return FakeCall(stream=gen())

        path = split_path(None, FakeHandle(generate_local=local))
        resumed = [ev async for ev in path.resumable_stream(preq, RequestTrace())]
        alone, crowded = await whole(preq), await whole(preq, crowd=3)
        unpenalized = await whole(dataclasses.replace(
            preq, sampling=dataclasses.replace(sp, presence_penalty=0.0, frequency_penalty=0.0)))
        await loop.close()
        return seen, resumed, alone, crowded, unpenalized

    seen, resumed, alone, crowded, unpenalized = asyncio.run(scenario())
    assert seen[1].output_offset == 6 and len(seen) == 2
    tokens = [e.token_id for e in alone]
    assert [e.token_id for e in resumed] == tokens == [e.token_id for e in crowded]
    assert [e.index for e in resumed] == list(range(len(tokens)))
    assert [e.logprobs.token_id for e in resumed] == tokens
    assert [e.logprobs.logprob for e in resumed] == pytest.approx(
        [e.logprobs.logprob for e in alone], abs=1e-4)
    assert 2 not in tokens[:10]
    assert [e.token_id for e in unpenalized] != tokens  # the penalties were in force


def test_the_trace_keeps_the_first_streams_cached_tokens_across_a_resume():
    """usage reports the prefix cache's share of the client's prompt: the first stream's.
    A retry re-prefills prompt + delivered tokens, mostly from the cache; that count is not
    the prompt's."""
    seen: list[PrefillRequest] = []

    def stream(preq):
        seen.append(preq)
        events = token_stream(preq, fail_at=5 if len(seen) == 1 else None)

        async def gen():
            first = await events.__anext__()
            yield dataclasses.replace(first, cached_tokens=2 if len(seen) == 1 else 7)
            async for item in events:
                yield item
        return gen()

    trace = RequestTrace()
    out = run(split_path(*hop_handles(stream)), request(), trace)
    assert [e.token_id for e in out] == TOKENS and trace.attempts == 2
    assert trace.cached_tokens == 2 and trace.stream_start.cached_tokens == 7


def test_a_resumed_stream_holds_stop_strings_off_for_the_same_tokens():
    """min_tokens counts the whole stream's index: a stream resumed within its min_tokens
    gives the ingress the same text as an undisturbed one."""
    from app.output import text_deltas

    class Tok:  # token 100 + k reads "ab", "c", "ab", "x", ... (k mod 4)
        def decode(self, ids, skip_special_tokens=True):
            return "".join(("ab", "c", "ab", "x")[(i - 100) % 4] for i in ids)

    sp = SamplingParams(max_tokens=len(TOKENS), temperature=0.0, stop=("ab",), min_tokens=3)
    preq = PrefillRequest("req", (1, 2, 3), sp)

    def text(fail_at: int | None) -> tuple[str, int]:
        calls: list[PrefillRequest] = []

        def stream(p):
            calls.append(p)
            return token_stream(p, fail_at=fail_at if len(calls) == 1 else None)

        async def collect():
            deltas = text_deltas(split_path(*hop_handles(stream)).resumable_stream(
                preq, RequestTrace()), Tok(), sp)
            return "".join([d.text async for d in deltas])
        return asyncio.run(collect()), len(calls)

    assert text(None) == ("abcabx", 1)  # "ab" of tokens 0 and 2 held off, token 4's stops
    assert text(2) == ("abcabx", 2)


class PhaseDown:
    """A decode phase that lost every replica at ``down_at`` and gets one back after
    ``down_for_s``: meanwhile its pings and calls fail as on a replica that is gone."""

    def __init__(self, down_for_s: float | None) -> None:
        self.down_for_s = down_for_s
        self.down_since: float | None = None
        self.pings = 0

    def up(self) -> bool:
        return self.down_since is None or (
            self.down_for_s is not None
            and time.perf_counter() - self.down_since >= self.down_for_s)

    def ping(self) -> FakeCall:
        self.pings += 1
        return FakeCall(value="node" if self.up() else ray.exceptions.ActorDiedError())

    def stream(self, preq: PrefillRequest) -> AsyncIterator[Any]:
        async def gen():
            if not self.up():
                raise ray.exceptions.ActorDiedError()
            async for item in token_stream(preq):
                if isinstance(item, TokenEvent) and item.index == 3 \
                        and self.down_since is None:
                    self.down_since = time.perf_counter()  # the whole phase dies mid-stream
                    raise ray.exceptions.ActorDiedError()
                yield item
        return gen()


def phase_down_path(phase: PhaseDown, **kw: Any) -> tuple[SplitPath, FakeHandle]:
    prefill = FakeHandle(make_kv_package=lambda preq: FakeCall(value=preq))
    decode = FakeHandle(generate=lambda wrapped: FakeCall(stream=phase.stream(wrapped[0])),
                        ping=phase.ping)
    return split_path(prefill, decode, **kw), prefill


def test_a_phase_that_lost_every_replica_is_waited_for_without_spending_retries():
    """Every decode replica dies mid-stream; replacements answer 0.6 s later. The request
    waits for them (one retry, not the whole budget), resumes with nothing missing or
    repeated, and its trace says what it waited for."""
    phase = PhaseDown(down_for_s=0.6)
    path, prefill = phase_down_path(phase, max_retries=1, retry_backoff_s=0.01)
    trace = RequestTrace()
    out = run(path, request(), trace)
    assert [e.token_id for e in out] == TOKENS
    assert path.retries == 1 and len(prefill.calls) == 2 and phase.pings > 1
    [retry] = trace.retries
    assert retry["error"] == "ActorDiedError" and retry["delivered"] == 3
    assert 0.4 <= retry["replica_wait_s"] < 10
    assert trace.as_dict()["retries"] == [retry]


def test_a_phase_that_never_comes_back_ends_the_request_at_its_deadline():
    """No replacement within the deadline: the client gets the timeout (504) at the
    deadline set when the request arrived (retries do not extend it)."""
    phase = PhaseDown(down_for_s=None)
    path, _ = phase_down_path(phase, request_timeout_s=1.0, retry_backoff_s=0.01)
    t = time.perf_counter()
    with pytest.raises(RequestTimeoutError):
        run(path, request())
    assert 0.9 <= time.perf_counter() - t < 3.0


def test_a_short_prompt_skips_a_backed_up_prefill_phase_and_the_backlog_drains():
    """``local_prefill_when_busy``: while the prompt tokens sent to the prefill phase whose
    streams have not started reach ``prefill_busy_tokens``, a short prompt is prefilled on
    the decode replica (its trace says why) and a long one still hops; once the long
    prompt's stream starts, the backlog is empty and short prompts hop again."""
    held = asyncio.Event()
    # the document's prefill stays queued until ``held`` is set
    remote_stream = gated_stream(held, lambda preq: preq.num_tokens > 100)
    prefill, decode = hop_handles(remote_stream)
    decode.methods["generate_local"] = lambda preq: FakeCall(stream=token_stream(preq))
    path = split_path(prefill, decode, local_prefill_when_busy=64, prefill_busy_tokens=256)
    doc = PrefillRequest("doc", tuple(range(300)), SamplingParams(max_tokens=len(TOKENS),
                                                                  temperature=0.0))
    mid = PrefillRequest("mid", tuple(range(64)), SamplingParams(max_tokens=len(TOKENS),
                                                                 temperature=0.0))

    async def scenario():
        traces = {k: RequestTrace() for k in ("idle", "doc", "chat", "mid", "after")}

        async def collect(preq, key):
            return [ev.token_id async for ev in path.resumable_stream(preq, traces[key])]

        # nothing queued at the prefill phase: a short prompt hops
        assert await collect(request(), "idle") == TOKENS
        doc_task = asyncio.create_task(collect(doc, "doc"))
        await asyncio.sleep(0.05)
        assert path.prefill_backlog_tokens == 300
        # backed up: the short prompt is prefilled locally; one of 64 tokens is not short
        assert await collect(request(), "chat") == TOKENS
        assert await collect(mid, "mid") == TOKENS
        held.set()
        assert await doc_task == TOKENS
        assert path.prefill_backlog_tokens == 0
        assert await collect(request(), "after") == TOKENS
        return traces

    traces = asyncio.run(scenario())
    routed = [(name, args[0][0].request_id if name == "generate" else args[0].request_id)
              for name, args in decode.calls]
    assert routed == [("generate", "req"), ("generate", "doc"), ("generate_local", "req"),
                      ("generate", "mid"), ("generate", "req")]
    assert path.local_when_busy == 1
    assert traces["chat"].as_dict()["prefill_busy_backlog_tokens"] == 300
    assert "prefill_busy_backlog_tokens" not in traces["idle"].as_dict()


def test_the_backlog_is_given_back_when_a_queued_prefill_fails_or_is_cancelled():
    prefill = FakeHandle(make_kv_package=lambda preq: FakeCall(value=QueueFullError("full")))
    path = split_path(prefill, FakeHandle(), local_prefill_when_busy=64,
                      prefill_busy_tokens=1)
    with pytest.raises(QueueFullError):
        run(path, request())
    assert path.prefill_backlog_tokens == 0

    prefill, decode = hop_handles(gated_stream(asyncio.Event()))  # never starts
    path = split_path(prefill, decode, local_prefill_when_busy=64, prefill_busy_tokens=1)

    async def cancelled():
        task = asyncio.create_task(run_async(path, request()))
        await asyncio.sleep(0.05)
        assert path.prefill_backlog_tokens == 3
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        return path.prefill_backlog_tokens

    assert asyncio.run(cancelled()) == 0


async def run_async(path: SplitPath, preq: PrefillRequest) -> list[TokenEvent]:
    return [ev async for ev in path.resumable_stream(preq, RequestTrace())]


def _route_burst(chats: int, **path_kwargs):
    """A 1,000-token document queued at the prefill phase, then ``chats`` 64-token chats
    arriving 10 ms apart, no stream starting until all are routed. Returns where each chat
    was prefilled ("generate": the prefill phase, "generate_local": the decode replica),
    the path's backlog counts (prefill, short there, local) while they were queued, and the
    path."""
    release = asyncio.Event()
    held = gated_stream(release)  # no stream starts until the burst has been routed
    prefill, decode = hop_handles(held)
    decode.methods["generate_local"] = lambda preq: FakeCall(stream=held(preq))
    path = split_path(prefill, decode, local_prefill_when_busy=128, prefill_busy_tokens=256,
                      **path_kwargs)
    doc = PrefillRequest("doc", tuple(range(1000)), SamplingParams(max_tokens=len(TOKENS),
                                                                   temperature=0.0))
    requests = [PrefillRequest(f"c{i}", tuple(range(64)),
                               SamplingParams(max_tokens=len(TOKENS), temperature=0.0))
                for i in range(chats)]

    async def scenario():
        tasks = [asyncio.create_task(run_async(path, doc))]
        for chat in requests:
            await asyncio.sleep(0.01)
            tasks.append(asyncio.create_task(run_async(path, chat)))
        await asyncio.sleep(0.05)
        counts = (path.prefill_backlog_tokens, path.short_backlog_tokens,
                  path.local_backlog_tokens)
        release.set()
        outs = await asyncio.gather(*tasks)
        return counts, outs

    counts, outs = asyncio.run(scenario())
    assert all([e.token_id for e in out] == TOKENS for out in outs)
    where = {(args[0][0] if name == "generate" else args[0]).request_id: name
             for name, args in decode.calls}
    return [where[c.request_id] for c in requests], counts, path


def test_a_burst_of_short_prompts_is_shared_between_the_phases_by_tokens_ahead():
    """With a document queued at the prefill phase, 64-token chats arriving together go to
    whichever side has fewer tokens ahead of them: the decode replicas' local prompts not
    yet streaming, against the short prompts at the prefill phase plus two passes of the
    document (the one under way, and the chunk that fills the chat's own pass)."""
    where, counts, path = _route_burst(10)
    # ahead at the prefill phase: 0 short + 2 x 256 of the document; locally 0, 64, ...
    # tokens: c0-c7 go local (448 < 512), c8 hops (512 vs 512), c9 local (512 < 64 + 512)
    assert where == ["generate_local"] * 8 + ["generate", "generate_local"]
    assert counts == (1000 + 64, 64, 9 * 64)
    assert (path.prefill_backlog_tokens, path.short_backlog_tokens,
            path.local_backlog_tokens) == (0, 0, 0)


def test_where_prefill_passes_pause_for_short_prompts_a_burst_shares_both_phases():
    """``prefill_preempts``: the document queued at the prefill phase makes a chat wait only
    a few layers of its pass (counted as a quarter of a pass, 64 tokens here), so a burst
    of chats alternates between the two sides by the tokens ahead of each, instead of going
    to the decode replicas until their backlog reaches two passes."""
    where, _, _ = _route_burst(6, prefill_preempts=True)
    # ahead at the prefill phase: short there + 256 // 4; locally 0, 64, ... tokens:
    # c0 local (0 < 64), c1 hops (64 vs 64), c2 local (64 < 128), c3 hops (128 vs 128), ...
    assert where == ["generate_local", "generate"] * 3


def test_the_ingress_calls_the_phases_by_reference_whatever_the_clusters_default(monkeypatch):
    """Serve's gRPC transport (``RAY_SERVE_USE_GRPC_BY_DEFAULT``, which
    ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` turns on) makes a handle's calls by value, and a
    by-value call has no ObjectRef to give: the KV package's ``_to_object_ref`` raised and
    every split request answered 500. The ingress's handles call by reference, streaming
    ones too (``SplitPath`` and the token feed add ``stream=True``)."""
    from ray.serve._private.handle_options import DynamicHandleOptions
    from ray.serve.handle import DeploymentHandle

    from deployments.ingress import by_reference

    # no Serve instance here: a handle's router is made when it is first used
    monkeypatch.setattr(DeploymentHandle, "_init",
                        lambda self, **_: setattr(self, "_router", object()))
    by_value = DeploymentHandle("DecodeServer", "app",
                                handle_options=DynamicHandleOptions(_by_reference=False))
    handle = by_reference(by_value)
    assert by_value.handle_options._by_reference is False
    assert handle.handle_options._by_reference is True
    streaming = handle.options(stream=True)
    assert streaming.handle_options._by_reference is True and streaming.handle_options.stream
    assert by_reference(None) is None  # the colocated app has no prefill phase
