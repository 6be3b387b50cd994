"""Mixed batching (``mixed_batch``) in the colocated app, and in a decode replica's local
prefills: while streams decode, a prompt's chunks ride in the decode steps, so every stream
gets exactly its own tokens and waits one pass per token; off, prompts get passes of their
own between the steps. The real ``ColocatedServer`` (and ``DecodeServer``) on the tiny
model, without Ray (node id and metrics stubbed)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch

from app.messages import PrefillRequest, StreamStart
from app.prefill import Prefiller
from app.sampling import SamplingParams
from deployments.colocated_server import ColocatedServer
from deployments.decode_server import DecodeServer
from tests.conftest import hf_greedy


@pytest.fixture
def make_server(rayless_replicas):
    def make(server_cls: Any = ColocatedServer, **engine: Any) -> Any:
        args: dict[str, Any] = {"engine": {"prefill_chunk_tokens": 16, **engine}}
        if server_cls is ColocatedServer:
            args["colocated"] = {}
        return server_cls.func_or_class(args)
    return make


def _log_passes(server: ColocatedServer) -> list[tuple[str, int]]:
    """Every forward pass from now on, in order: (kind, decode rows)."""
    runner, log = server.core.runner, []
    prefill, decode, mixed = runner.prefill_layers, runner.decode, runner.forward_mixed

    def logged_prefill(prompts, *rest):
        log.append(("prefill", 0))
        return prefill(prompts, *rest)

    def logged_decode(cache, tables, *args):
        log.append(("decode", len(tables)))
        return decode(cache, tables, *args)

    def logged_mixed(cache, tables, *args):
        log.append(("mixed", len(tables)))
        return mixed(cache, tables, *args)

    runner.prefill_layers, runner.decode = logged_prefill, logged_decode
    runner.forward_mixed = logged_mixed
    return log


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _greedy(rid: str, prompt: list[int], max_tokens: int) -> PrefillRequest:
    return PrefillRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens,
                                                             temperature=0.0))


async def _run(server: ColocatedServer, req: PrefillRequest,
               started: asyncio.Event | None = None, decoding: int = 0) -> dict[str, Any]:
    """One request through ``generate_local``: its StreamStart and tokens; ``started`` is
    set once it has ``decoding`` tokens from decode steps."""
    out: dict[str, Any] = {"tokens": []}
    async for item in server.generate_local(req):
        if isinstance(item, StreamStart):
            out["start"] = item
            continue
        out["tokens"].append(item.token_id)
        if started is not None and len(out["tokens"]) > decoding:
            started.set()
    return out


async def _stream_then_doc(server: ColocatedServer, doc_len: int = 60):
    """A 40-token stream, and a ``doc_len``-token prompt that arrives once the stream has
    two tokens from decode steps."""
    stream_prompt, doc = _ids(10, seed=1), _ids(doc_len, seed=2)
    decoding = asyncio.Event()
    stream = asyncio.create_task(_run(server, _greedy("s", stream_prompt, 40), decoding, 2))
    await asyncio.wait_for(decoding.wait(), 60)
    doc_out = await _run(server, _greedy("doc", doc, 3))
    stream_out = await stream
    return (stream_prompt, stream_out["tokens"]), (doc, doc_out["tokens"])


async def test_streams_get_their_own_tokens_while_long_prompts_arrive(make_server,
                                                                      tiny_model):
    server = make_server(prefix_cache_mb=16)
    assert server.stats()["mixed_batch"] is True
    log = _log_passes(server)
    streams = [(f"s{i}", _ids(5 + 3 * i, seed=10 + i), 30 + 4 * i) for i in range(3)]
    decoding = [asyncio.Event() for _ in streams]
    tasks = [asyncio.create_task(_run(server, _greedy(rid, p, m), ev, 1))
             for (rid, p, m), ev in zip(streams, decoding, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in decoding)), 60)

    doc_a, doc_b = _ids(70, seed=20), _ids(50, seed=21)
    doc_c = doc_a[:48] + _ids(20, seed=22)  # shares doc_a's first three 16-token blocks
    a_started = asyncio.Event()
    docs = [asyncio.create_task(_run(server, _greedy("a", doc_a, 6), a_started)),
            asyncio.create_task(_run(server, _greedy("b", doc_b, 6)))]
    await asyncio.wait_for(a_started.wait(), 60)  # a's package is made: c finds its blocks
    docs.append(asyncio.create_task(_run(server, _greedy("c", doc_c, 6))))
    # n = 2, sampled, with logprobs, prefilled while the streams run
    sampled = PrefillRequest("n2", tuple(_ids(37, seed=23)),
                             SamplingParams(max_tokens=4, temperature=0.9, seed=5, logprobs=2),
                             n=2)
    shared = await server.make_kv_package(sampled)
    outs = await asyncio.gather(*tasks)
    doc_outs = await asyncio.gather(*docs)
    await server.loop.close()

    for (_, prompt, max_tokens), out in zip(streams, outs, strict=True):
        assert out["tokens"] == hf_greedy(tiny_model, prompt, max_tokens)
    for prompt, out in zip((doc_a, doc_b, doc_c), doc_outs, strict=True):
        assert out["tokens"] == hf_greedy(tiny_model, prompt, 6)
    assert doc_outs[2]["start"].cached_tokens == 48  # the prefix cache still serves
    core = server.core
    [alone] = Prefiller(core.runner, core.fingerprint, None).make_packages([sampled])
    assert shared.choice_first_tokens == alone.choice_first_tokens
    assert ([lp.token_id for lp in shared.choice_first_logprobs]
            == [lp.token_id for lp in alone.choice_first_logprobs])
    torch.testing.assert_close(shared.kv_tensor(), alone.kv_tensor(), rtol=1e-5, atol=1e-5)
    # the documents' chunks rode in decode steps
    assert server.batcher.mixed_passes >= 4 and any(k == "mixed" for k, _ in log)
    assert server.batcher.waiting_requests == 0 and server.batcher.jobs == []


@pytest.mark.parametrize("server_cls", [ColocatedServer, DecodeServer])
async def test_a_stream_waits_one_mixed_pass_per_token_while_a_prompt_is_prefilled(
        make_server, tiny_model, server_cls):
    """The colocated app, and a decode replica prefilling a prompt locally (a short one
    under ``local_prefill_threshold``, or while the prefill phase is backed up)."""
    server = make_server(server_cls, prefix_cache_mb=0)
    log = _log_passes(server)
    (prompt, tokens), (doc, doc_tokens) = await _stream_then_doc(server)
    await server.loop.close()
    assert tokens == hf_greedy(tiny_model, prompt, 40)
    assert doc_tokens == hf_greedy(tiny_model, doc, 3)
    # the stream's own prefill, then its 39 decode steps: nothing else, and no prefill pass
    # among them; 16-token passes with 1 decode row: the document's 60 tokens in 4 of them
    assert log[0] == ("prefill", 0)
    assert [k for k, _ in log[1:]].count("prefill") == 0
    assert len(log[1:]) == len(tokens) - 1
    assert [k for k, _ in log].count("mixed") == 4
    assert all(rows >= 1 for _, rows in log[1:])
    assert server.batcher.mixed_passes == 4
    assert server.stats()["mixed_passes"] == 4


@pytest.mark.parametrize("server_cls", [ColocatedServer, DecodeServer])
async def test_mixed_batch_off_runs_prompt_chunks_as_passes_between_steps(make_server,
                                                                          tiny_model,
                                                                          server_cls):
    server = make_server(server_cls, prefix_cache_mb=0, mixed_batch=False)
    assert server.loop.prefill_source is None
    log = _log_passes(server)
    (prompt, tokens), (doc, doc_tokens) = await _stream_then_doc(server)
    await server.loop.close()
    assert tokens == hf_greedy(tiny_model, prompt, 40)
    assert doc_tokens == hf_greedy(tiny_model, doc, 3)
    kinds = [k for k, _ in log]
    # today's schedule: the document's 4 chunks are passes of their own between the steps
    assert "mixed" not in kinds
    assert kinds.count("prefill") == 1 + 4
    assert kinds.count("decode") == len(tokens) - 1
    assert server.batcher.mixed_passes == 0 and server.batcher.passes == 5


async def test_with_nothing_decoding_prompts_get_plain_prefill_passes(make_server):
    server = make_server(prefix_cache_mb=0)
    log = _log_passes(server)
    pkgs = await asyncio.gather(*(server.make_kv_package(_greedy(f"p{i}", _ids(40, i), 4))
                                  for i in range(2)))
    assert all(p.seq_len == 40 for p in pkgs)
    assert {k for k, _ in log} == {"prefill"} and server.batcher.mixed_passes == 0


async def test_a_failing_mixed_step_fails_its_prompts_and_streams_and_the_app_goes_on(
        make_server, tiny_model):
    server = make_server(prefix_cache_mb=0)
    runner = server.core.runner
    real_mixed = runner.forward_mixed

    def broken(*args):
        raise RuntimeError("mixed pass broke")

    runner.forward_mixed = broken
    decoding = asyncio.Event()
    stream = asyncio.create_task(_run(server, _greedy("s", _ids(10, 1), 40), decoding, 1))
    await asyncio.wait_for(decoding.wait(), 60)
    with pytest.raises(RuntimeError, match="mixed pass broke"):
        await asyncio.wait_for(server.make_kv_package(_greedy("doc", _ids(40, 2), 3)), 60)
    assert (await stream)["tokens"][-1] is None  # the stream ended with an error event
    runner.forward_mixed = real_mixed
    doc = _ids(40, 3)
    out = await asyncio.wait_for(_run(server, _greedy("after", doc, 3)), 60)
    await server.loop.close()
    assert out["tokens"] == hf_greedy(tiny_model, doc, 3)
    assert server.batcher.jobs == [] and server.batcher.waiting_requests == 0
