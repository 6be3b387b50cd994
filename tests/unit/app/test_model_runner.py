"""Model runner placement: devices read from the model, the KV buffer split per device span,
and bfloat16 weights + KV end to end. On CPU every code path of the GPU placement runs with the
device chosen explicitly; only the devices themselves are all ``cpu``."""

from __future__ import annotations

import asyncio
import pickle
import random

import torch

from app.config import EngineConfig
from app.engine_core import EngineCore
from app.messages import PrefillRequest
from app.model_runner import LayerSpan, layer_spans
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
    kv = runner.allocate(3, 100)
    assert len(kv.parts) == 1 and tuple(kv.parts[0].shape[:3]) == (2, 2, 4)
    assert len(kv.layers) == 2
    assert kv.layers[1].data_ptr() == kv.parts[0][1].data_ptr()  # views, not copies


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

    kv = runner.allocate(2, 64)
    assert [tuple(part.shape[:3]) for part in kv.parts] == [(1, 2, 2), (1, 2, 2)]
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    [pkg] = core.make_prefiller().make_packages([PrefillRequest("x", tuple(prompts[0]), greedy)])
    runner.load_row(kv, 1, pkg.kv_tensor(runner.kv_device))
    n = pkg.seq_len
    full = pkg.kv_tensor()
    assert torch.equal(kv.parts[0][0, :, 1, :, :n], full[0])  # layer 0 -> first part
    assert torch.equal(kv.parts[1][0, :, 1, :, :n], full[1])  # layer 1 -> second part
    grown = runner.allocate(4, 256, old=kv)  # growing keeps every part's rows
    assert torch.equal(grown.parts[1][0, :, 1, :, :n], full[1])
    runner.move_row(grown, 1, 0, n)
    assert torch.equal(grown.parts[0][0, :, 0, :, :n], full[0])


async def test_bfloat16_weights_and_kv_match_generate_in_bfloat16():
    """dtype bfloat16 (KV in bfloat16 too): prefill, the KV package through pickle protocol 5
    (its uint16 wire form), decode; greedy equals generate() of the bf16 model. Each request
    decodes alone: in a batch, rows of different lengths attend under a mask (another SDPA
    kernel), and bf16 rounding may then flip a near-tie, as it may in any batched server."""
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


def test_batch_buffer_rounding_and_growth_zeroes_what_it_does_not_copy(tiny_model):
    """Rows round to 1, 2, 4, then multiples of 4; positions to multiples of 128 (a
    reservation just past a power of two no longer doubles the buffer). A grown buffer holds
    the old rows' KV and zeros everywhere else (it is allocated uninitialized)."""
    from app.model_runner import round_capacity, round_rows

    assert [round_rows(n) for n in (1, 2, 3, 4, 5, 8, 9, 13)] == [1, 2, 4, 4, 8, 8, 12, 16]
    assert [round_capacity(n) for n in (1, 128, 129, 1040)] == [128, 128, 256, 1152]
    runner = EngineCore(EngineConfig(), model=tiny_model).runner
    assert runner.kv_tokens_for(5, 1040) == 8 * 1152
    kv = runner.allocate(2, 100)
    assert (kv.rows, kv.capacity) == (2, 128)
    kv.parts[0].fill_(7.0)
    grown = runner.allocate(5, 300, old=kv)
    assert (grown.rows, grown.capacity) == (8, 384)
    part = grown.parts[0]
    assert bool((part[:, :, :2, :, :128] == 7.0).all())
    assert not bool(part[:, :, :2, :, 128:].any()) and not bool(part[:, :, 2:].any())


def test_ragged_plan_attends_outliers_alone_only_when_it_pays():
    from app.model_runner import RaggedDecode, plan_ragged

    # eleven chats near 150 and one 1,040-token document: the document alone, the rest to 200
    lengths = [100, 120, 130, 140, 150, 160, 170, 180, 190, 200, 110, 1040]
    assert plan_ragged(lengths, 512) == RaggedDecode(200, ((11, 1040),))
    assert plan_ragged(lengths, 8192) is None  # a call dearer than the positions it saves
    assert plan_ragged([150] * 12, 0) is None  # equal lengths: nothing to save
    assert plan_ragged([100, 180, 250, 300], 512) is None  # the saving would not pay
    assert plan_ragged([5, 40, 6, 7], 0) == RaggedDecode(7, ((1, 40),))


async def test_ragged_decode_steps_match_generate(tiny_model, monkeypatch):
    """With every uneven batch split (no per-call cost), rows of very different lengths are
    attended each to its own length, and greedy tokens still equal generate()."""
    from app import model_runner

    core = EngineCore(EngineConfig(max_batch_size=8), model=tiny_model)
    assert core.runner.ragged and core.runner.row_call_positions == 512
    core.runner.row_call_positions = 0
    planned = []
    real_plan = model_runner.plan_ragged

    def spy(lengths, row_call_positions):
        plan = real_plan(lengths, row_call_positions)
        planned.append(plan)
        return plan

    monkeypatch.setattr(model_runner, "plan_ragged", spy)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 60, 5, 120, 9)]
    max_tokens = [12, 6, 9, 10, 4]
    outs = await _decode_all(core, prompts, max_tokens)
    assert any(p is not None and len(p.long_rows) >= 2 for p in planned)
    for p, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out == hf_greedy(tiny_model, p, m)
