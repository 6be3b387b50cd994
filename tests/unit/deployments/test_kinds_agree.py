"""One answer whatever the path, for every kind of weight the engine serves (issue 29): a
greedy answer through the split app (a prefill replica's KV package, pickled as the object
store would carry it, decoded by a decode replica), through the colocated app (the prompt
prefilled alone, and again riding in a running stream's decode steps) and through the CLI
(``python -m app generate``) is the same, at float32, with bf16 panels (``dtype:
bfloat16``) and with int8 panels (``weights: int8``, and ``int8-g32``: a scale per 32 of k).

The replica classes are the real ones, built in this process (node id and metrics stubbed),
each loading the model from a folder as a replica does; the model is the tiny one (peaked
logits: every path's rounding keeps the same argmax), with SmolLM2's tokenizer beside it
for the CLI's text prompt."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from app.chat import PromptBuilder
from app.messages import PrefillRequest, StreamStart
from app.packed_linear import weight_kind
from app.sampling import SamplingParams
from deployments.colocated_server import ColocatedServer
from deployments.decode_server import DecodeServer
from deployments.prefill_server import PrefillServer
from tests.conftest import make_tiny_model
from tests.unit.deployments.conftest import stub_replicas

ROOT = Path(__file__).resolve().parents[3]
PROMPT = "The split app and the colocated app give one answer for every kind of weight"
MAX_TOKENS = 12
# (dtype, weights, the panels each may hold: the CPU picks the dot-product kind or the
# widened one, app.packed_linear.weight_plan)
KINDS = [("float32", None, {"float32"}), ("bfloat16", None, {"bfloat16", "bfloat16dp"}),
         ("float32", "int8", {"int8", "int8dp"}),
         # a scale per 32 of k: VNNI's int8 pairs, or bf16 panels without it
         ("float32", "int8-g32", {"int8dp-g32", "bfloat16", "bfloat16dp"})]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny-kinds")
    make_tiny_model(seed=5).save_pretrained(path)
    smollm_tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def replicas_here(monkeypatch) -> None:
    """Replica classes built in this process, each loading the model its config names."""
    stub_replicas(monkeypatch)


def _args(model_dir: Path, dtype: str, weights: str | None, **extra: Any) -> dict[str, Any]:
    engine = {"model": str(model_dir), "dtype": dtype, "prefix_cache_mb": 0,
              "prefill_chunk_tokens": 8}
    if weights is not None:
        engine["weights"] = weights
    return {"engine": engine, **extra}


def _ref(value: Any) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


async def _tokens(stream) -> list[int]:
    items = [item async for item in stream]
    assert isinstance(items[0], StreamStart)
    return [e.token_id for e in items[1:]]


def _request(rid: str, ids: list[int], max_tokens: int = MAX_TOKENS) -> PrefillRequest:
    return PrefillRequest(rid, tuple(ids), SamplingParams(max_tokens=max_tokens,
                                                          temperature=0.0, ignore_eos=True))


async def _close(server: Any) -> None:
    await server.loop.close()
    if server._stats_task is not None:
        server._stats_task.cancel()


async def _split(args: dict[str, Any], req: PrefillRequest) -> tuple[list[int], str]:
    prefill = PrefillServer.func_or_class(args)
    package = pickle.loads(pickle.dumps(await prefill.make_kv_package(req), protocol=5))
    decode = DecodeServer.func_or_class(args)
    try:
        return await _tokens(decode.generate([_ref(package)])), weight_kind(decode.core.model)
    finally:
        await _close(decode)


async def _colocated(args: dict[str, Any], req: PrefillRequest) -> tuple[list[int], list[int]]:
    """The prompt prefilled alone, then again while another stream decodes (its chunks in
    that stream's decode steps: at least one mixed pass)."""
    server = ColocatedServer.func_or_class({**args, "colocated": {}})
    runner, mixed = server.core.runner, []
    forward_mixed = runner.forward_mixed

    def counted(*a: Any) -> Any:
        mixed.append(1)
        return forward_mixed(*a)
    runner.forward_mixed = counted
    try:
        alone = await _tokens(server.generate_local(req))
        assert not mixed
        running = _request("running", list(range(400, 420)), max_tokens=40)
        stream = server.generate_local(running)
        items = [await anext(stream), await anext(stream)]  # the start and a first token
        again = asyncio.create_task(_tokens(server.generate_local(
            PrefillRequest("again", req.prompt_token_ids, req.sampling))))
        items += [item async for item in stream]
        assert len(items) == 41
        answer = await again
        assert mixed, "the prompt never rode in a decode step"
        return alone, answer
    finally:
        runner.forward_mixed = forward_mixed
        await _close(server)


def _cli(model_dir: Path, dtype: str, weights: str | None) -> dict[str, Any]:
    extra = ["--weights", weights] if weights else []
    proc = subprocess.run(
        [sys.executable, "-m", "app", "generate", "--model", str(model_dir), "--prompt",
         PROMPT, "--dtype", dtype, *extra, "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
         "--threads", str(torch.get_num_threads()), "--json"],
        cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
        timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.smollm
@pytest.mark.parametrize(("dtype", "weights", "panels"), KINDS,
                         ids=["float32", "bf16", "int8", "int8-g32"])
async def test_split_colocated_and_cli_give_one_answer(model_dir, smollm_tokenizer,
                                                       replicas_here, dtype, weights, panels):
    ids = PromptBuilder(smollm_tokenizer).encode_prompt(PROMPT)
    assert len(ids) > 8  # more than one chunk
    req = _request("req", ids)
    args = _args(model_dir, dtype, weights)
    split, kind = await _split(args, req)
    assert kind in panels
    alone, mixed = await _colocated(args, req)
    cli = await asyncio.to_thread(_cli, model_dir, dtype, weights)
    assert cli["prompt_token_ids"] == ids
    assert len(split) == MAX_TOKENS
    assert split == alone == mixed == cli["token_ids"], (split, alone, mixed, cli["token_ids"])
