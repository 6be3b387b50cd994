"""A decode step in one call to the engine's C kernel (app.fused_decode, app/csrc/decode_step.c):
the logits and KV the model's own modules give, the greedy tokens of generate(), and a clear
reason wherever a model is stepped through its modules instead."""

from __future__ import annotations

import pytest
import torch

from app import cpu_kernels
from app.config import EngineConfig
from app.engine_core import EngineCore
from app.model_runner import ModelRunner
from app.packed_linear import pack_linears
from tests.conftest import engine_greedy, hf_greedy, make_tiny_model
from tests.unit.app.test_weight_kinds import KINDS  # with the CPU's own kinds where it has them

pytestmark = pytest.mark.skipif(
    cpu_kernels.cpu_unsupported() is not None or cpu_kernels._compiler() is None,
    reason=f"{cpu_kernels.cpu_unsupported() or 'no C compiler'}")


def _runner(fused: bool, **overrides) -> ModelRunner:
    model = make_tiny_model(seed=3, **overrides)
    pack_linears(model, layout="panels")
    return ModelRunner(model, EngineConfig(kernels={"fused_decode": fused, "fused_layers": fused}))


def _steps(runner: ModelRunner, prompts: list[list[int]], steps: int):
    """Prefill ``prompts``, then ``steps`` greedy decode steps of them as one batch; each
    step's logits and, at the end, every row's keys and values read back from the pool."""
    cache = runner.make_kv_cache(64, 4)  # 4-token blocks: rows cross several
    per_row = 8
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(len(prompts))]
    logits, kvs = runner.forward_prefill(prompts)
    for table, kv in zip(tables, kvs, strict=True):
        cache.write(table, kv)
    tokens = logits.argmax(-1).tolist()
    positions = [len(p) for p in prompts]
    out = []
    for _ in range(steps):
        step_logits = runner.decode(cache, tables, tokens, positions)
        out.append(step_logits)
        tokens = step_logits.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    kv_after = [cache.read(t, n) for t, n in zip(tables, positions, strict=True)]
    return out, kv_after


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("biases", [False, True])
def test_the_fused_step_gives_the_logits_and_kv_of_the_models_modules(threads, biases):
    """Rows of different lengths (one of them 1 token, one across many blocks), with and
    without the biases Llama's config can add (q/k/v/o and the MLP's, as Qwen2's q/k/v)."""
    extra = {"attention_bias": True, "mlp_bias": True} if biases else {}
    fused, plain = _runner(True, **extra), _runner(False, **extra)
    assert fused.fused is not None and plain.fused is None
    prompts = [[5, 9, 33, 100, 7], list(range(40, 66)), [8], [300, 41, 8, 2, 2, 17, 90]]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, got_kv = _steps(fused, prompts, 6)
        want, want_kv = _steps(plain, prompts, 6)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for a, b in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights", ["float32", *KINDS])
def test_a_steps_values_are_the_same_on_any_number_of_threads(weights):
    """The step's products share their panels out over the threads: every logit and every
    key and value written is bit for bit the one thread's, for a batch of 4 on 2 and 3
    threads and a lone row on 3."""
    def run(threads: int, prompts: list[list[int]]):
        model = make_tiny_model(seed=3)
        pack_linears(model, layout="panels", weights=weights)
        runner = ModelRunner(model, EngineConfig())
        assert runner.fused is not None
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return _steps(runner, prompts, 4)
        finally:
            torch.set_num_threads(before)

    batch = [[5, 9, 33, 100, 7], list(range(40, 66)), [8], [300, 41, 8, 2, 2, 17, 90]]
    for prompts, counts in ((batch, (2, 3)), ([[12, 13, 14]], (3,))):
        want, want_kv = run(1, prompts)
        for threads in counts:
            got, got_kv = run(threads, prompts)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), (weights, threads)
            for a, b in zip(got_kv, want_kv, strict=True):
                assert torch.equal(a, b), (weights, threads)


async def test_the_engine_decodes_through_the_fused_step_by_default_and_gives_generates_tokens():
    prompts = [[5, 9, 13, 200, 7], list(range(100, 160)), [300, 41, 8], [77] * 30]
    expected = [hf_greedy(make_tiny_model(seed=6), p, 12) for p in prompts]
    for on in (True, False):
        model = make_tiny_model(seed=6)
        pack_linears(model)  # as the app's loader packs the model it loads
        core = EngineCore(EngineConfig(max_batch_size=8, kernels={"fused_decode": on}), model=model)
        assert (core.runner.fused is not None) is on
        if not on:
            assert "turned off" in core.runner.fused_reason
        outs, steps = await engine_greedy(core, prompts, 12)
        assert steps < 12 * len(prompts)  # rows shared steps
        assert outs == expected, on


@pytest.mark.parametrize(("config", "layout", "overrides", "reason"), [
    ({"kernels": {"attention": False}}, "panels", {}, "in place"),
    ({}, "onednn", {}, "panel-packed"),
    ({}, None, {}, "panel-packed"),
    ({}, "panels", {"hidden_act": "gelu"}, "activation"),
    ({}, "panels", {"intermediate_size": 120}, "multiples of 16"),
])
def test_a_model_the_kernel_does_not_compute_steps_through_its_modules(config, layout,
                                                                       overrides, reason):
    model = make_tiny_model(seed=1, **overrides)
    if layout is not None:
        pack_linears(model, layout=layout)
    core = EngineCore(EngineConfig(**config), model=model)
    assert core.runner.fused is None
    assert reason in core.runner.fused_reason


def test_qwen3s_per_head_norms_are_not_fused():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256)).eval()
    pack_linears(model, layout="panels")
    core = EngineCore(EngineConfig(), model=model)
    assert core.runner.fused is None
    assert "Qwen3DecoderLayer" in core.runner.fused_reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_table_is_the_modules_answer_at_every_position(dtype):
    """A decode step gathers cos/sin from a table the rotary module made once (grown as
    longer positions come) instead of calling the module each step: each row must be the
    module's own answer for that position, widened to float32, bit for bit, in the model's
    dtype (a bf16 model's module rounds to bf16). A module that rescales by the sequence
    length (dynamic rope) gets no table: it is asked every step."""
    from app.fused_decode import RotaryTable

    model = make_tiny_model(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    rotary = model.model.rotary_emb
    table = RotaryTable.for_module(rotary, dtype)
    for positions in ([0, 7, 3, 1023], [1024, 5, 2047], [9000, 0, 4096]):  # grows twice
        pos = torch.tensor(positions)
        cos, sin = table.rows(pos)
        probe = torch.zeros(len(positions), 1, 64, dtype=dtype)
        want_cos, want_sin = rotary(probe, pos.unsqueeze(1))
        assert cos.dtype == torch.float32 and cos.shape == (len(positions), 16)
        assert torch.equal(cos, want_cos[:, 0].float())
        assert torch.equal(sin, want_sin[:, 0].float())
    assert len(table.cos) == 9001
    dynamic = make_tiny_model(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                               "rope_theta": 10000.0})
    assert RotaryTable.for_module(dynamic.model.rotary_emb, dtype) is None
