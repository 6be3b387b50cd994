"""Model runner placement: devices read from the model, the KV pool split per device span,
and bfloat16 weights + KV end to end. On CPU every code path of the GPU placement runs with the
device chosen explicitly; only the devices themselves are all ``cpu``."""

from __future__ import annotations

import asyncio
import pickle
import random

import torch

from app.config import EngineConfig
from app.engine_core import EngineCore
from app.kv_cache import LayerSpan, layer_spans
from app.messages import PrefillRequest
from app.sampling import SamplingParams
from tests.conftest import hf_greedy, make_tiny_model

CPU = torch.device("cpu")


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


async def _decode_all(core: EngineCore, prompts: list[list[int]], max_tokens: list[int],
                      *, via_pickle: bool = False) -> list[list[int]]:
    """Prefill all prompts, then decode them together in one batch (greedy)."""
    reqs = [PrefillRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=m, temperature=0.0))
            for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
    packages = core.make_prefiller().make_packages(reqs)
    if via_pickle:  # as Ray ships a package: pickle protocol 5, buffers out of band
        shipped = []
        for pkg in packages:
            buffers: list[pickle.PickleBuffer] = []
            data = pickle.dumps(pkg, protocol=5, buffer_callback=buffers.append)
            shipped.append(pickle.loads(data, buffers=buffers))
        packages = shipped
    loop = core.make_decode_loop(frozenset())

    async def collect(pkg):
        return [ev.token_id async for ev in loop.generate(pkg)]

    outs = await asyncio.gather(*(collect(p) for p in packages))
    await loop.close()
    return outs


def test_layer_spans_group_consecutive_layers_by_device():
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    assert layer_spans([CPU, CPU, CPU]) == [LayerSpan(0, 3, CPU)]
    assert layer_spans([d0, d0, d1, d1, d1]) == [LayerSpan(0, 2, d0), LayerSpan(2, 5, d1)]
    # a device that comes back after another starts a new span (layers stay consecutive)
    assert layer_spans([d0, d1, d0]) == [LayerSpan(0, 1, d0), LayerSpan(1, 2, d1),
                                         LayerSpan(2, 3, d0)]


def test_runner_reads_devices_from_the_model(tiny_model):
    runner = EngineCore(EngineConfig(), model=tiny_model).runner
    assert runner.device == tiny_model.model.embed_tokens.weight.device
    assert runner.output_device == tiny_model.lm_head.weight.device
    assert runner.layer_devices == [CPU, CPU]
    assert runner.spans == [LayerSpan(0, 2, CPU)] and runner.kv_device == CPU
    assert not runner.multi_device  # one device: no per-layer moves in the hot path
    cache = runner.make_kv_cache(num_blocks=4, block_size=8)
    assert len(cache.parts) == 1 and tuple(cache.parts[0].shape[:3]) == (2, 2, 32)
    assert len(cache.layers) == 2
    assert cache.layers[1].data_ptr() == cache.parts[0][1].data_ptr()  # views, not copies


async def test_kv_split_over_spans_decodes_like_generate(tiny_model):
    """The layout a device_map gives (one KV part per device span, explicit moves at span
    boundaries), run on CPU: greedy tokens still equal the model's own generate()."""
    core = EngineCore(EngineConfig(max_batch_size=8), model=tiny_model)
    runner = core.runner
    runner.spans = [LayerSpan(0, 1, CPU), LayerSpan(1, 2, CPU)]
    runner.multi_device = True
    prompts = _prompts(5, seed=4)
    max_tokens = [3, 9, 5, 12, 7]
    outs = await _decode_all(core, prompts, max_tokens)
    for p, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out == hf_greedy(tiny_model, p, m)

    cache = runner.make_kv_cache(num_blocks=8, block_size=4)
    assert [tuple(part.shape[:3]) for part in cache.parts] == [(1, 2, 32), (1, 2, 32)]
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    [pkg] = core.make_prefiller().make_packages([PrefillRequest("x", tuple(prompts[0]), greedy)])
    n = pkg.seq_len
    table = [6, 1, 3, 0, 7, 2, 4, 5][: -(-n // 4)]
    cache.write(table, pkg.kv_tensor(runner.kv_device))
    full = pkg.kv_tensor()
    slots = torch.tensor(cache.slots(table, 0, n))
    # layer 0 -> first part, layer 1 -> second part; [2, n, kv_heads, hd] per layer
    assert torch.equal(cache.parts[0][0][:, slots], full[0].transpose(1, 2))
    assert torch.equal(cache.parts[1][0][:, slots], full[1].transpose(1, 2))
    assert torch.equal(cache.read(table, n), full)


async def test_bfloat16_weights_and_kv_match_generate_in_bfloat16():
    """dtype bfloat16 (KV in bfloat16 too): prefill, the KV package through pickle protocol 5
    (its uint16 wire form), decode; greedy equals generate() of the bf16 model. Each request
    decodes alone: in a batch, rows attend under a block-diagonal mask (another SDPA kernel
    call), and bf16 rounding may then flip a near-tie, as it may in any batched server."""
    model = make_tiny_model(seed=5).to(torch.bfloat16)
    core = EngineCore(EngineConfig(dtype="bfloat16"), model=model)
    assert core.runner.kv_dtype is torch.bfloat16
    assert core.fingerprint.split("/")[5] == "bfloat16"
    prompts = _prompts(4, seed=9)
    max_tokens = [8, 8, 8, 8]
    alone = [await _decode_all(core, [p], [m], via_pickle=True)
             for p, m in zip(prompts, max_tokens, strict=True)]
    for p, m, [out] in zip(prompts, max_tokens, alone, strict=True):
        assert out == hf_greedy(model, p, m)
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    [pkg] = core.make_prefiller().make_packages([PrefillRequest("k", tuple(prompts[0]), greedy)])
    assert pkg.layout.kv_dtype == "bfloat16" and pkg.kv.dtype.itemsize == 2
