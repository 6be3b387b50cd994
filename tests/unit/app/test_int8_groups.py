"""int8 weights with a scale per output for each group of k (``weights: int8-g<N>``, or a
compressed-tensors checkpoint of the ``group`` strategy): the VNNI kernel computes what the
grouped integers and scales compute, a row's result does not depend on its batch, the
engine's greedy tokens equal the plain model's over the same weights, a checkpoint's own
integers and scales are what the panels hold, and without AVX512-VNNI the weights are served
as bf16 panels instead, which the plan says."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.config import EngineConfig, weight_group
from app.cpu_kernels import KernelError, check, kernel_unavailable, load_kernel, wtype_code
from app.engine_core import EngineCore
from app.errors import ModelLoadError
from app.model_loader import load_model
from app.packed_linear import PanelLinear, pack_linears, quantize_int8, weight_kind, weight_plan
from app.quantized_checkpoint import CHECKPOINT_INT8, dequantize, int8_format
from load_tests.int8_checkpoint import write
from tests.conftest import engine_greedy, hf_greedy, make_tiny_model
from tests.unit.app.test_weight_kinds import PROMPTS, _inputs, _vnni, reference_model

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason="the panel kernel needs x86-64 with AVX2/FMA and a compiler")
needs_vnni = pytest.mark.skipif(not _vnni(), reason="the CPU has no AVX512-VNNI (or is kept "
                                "to AVX2): grouped int8 is served as bf16 there, tested below")


def _written_or_quantized(written: dict[str, tuple], group: int = 32):
    """A linear's weight as the engine holds it: a checkpoint's written integers, scales
    (and offsets), else quantized at load with a scale per ``group``; dequantized."""
    def weight_of(name: str, linear: nn.Linear) -> torch.Tensor:
        q, scale, *offset = written.get(name) or quantize_int8(linear.weight, group)
        return dequantize(q, scale, group, *offset)
    return weight_of


@pytest.fixture
def kept_to_avx2():
    """The kernels as an AVX2-only CPU has them (no VNNI, no AVX512-BF16), then as before
    (kept to AVX2 still where SPLITSERVE_KERNEL_ISA=avx2 kept them)."""
    lib = load_kernel()
    before = lib.panel_avx2_only()
    lib.panel_limit_avx2(1)
    yield lib
    lib.panel_limit_avx2(before)


@needs_vnni
@pytest.mark.parametrize(("n", "k", "group"), [(96, 64, 32), (100, 71, 32), (576, 576, 128),
                                               (48, 300, 2), (40, 1100, 512)])
@torch.inference_mode()
def test_a_grouped_product_is_its_weights_and_the_same_in_any_batch(n, k, group):
    torch.manual_seed(n + k)
    linear = nn.Linear(k, n)
    panel = PanelLinear(linear, weights="int8dp", group=group)
    q, scale = quantize_int8(linear.weight, group)
    assert torch.equal(panel.weight, q) and scale.shape == (n, -(-k // group))
    weight = dequantize(q, scale, group)
    for m in (1, 2, 3, 7, 8, 13, 49, 130):
        x = torch.randn(m, k)
        want = F.linear(_inputs(x, "int8dp", group), weight, linear.bias)
        got = panel(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * k ** 0.5)
        assert torch.equal(panel(x[m // 2:m // 2 + 1])[0], got[m // 2])  # batch of one


@needs_vnni
@pytest.mark.parametrize(("n", "k", "group"), [(96, 64, 32), (100, 71, 32), (40, 1100, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@torch.inference_mode()
def test_an_offset_per_group_is_added_as_the_weights_say(n, k, group, dtype):
    """Weights ``q * scale + offset`` (a GGUF Q4_1 block's form: app.gguf_blocks, its scales
    float16): the offsets times each group's inputs' sum join the products, in any batch
    alike."""
    torch.manual_seed(n)
    linear = nn.Linear(k, n)
    groups = -(-k // group)
    q = torch.randint(0, 16, (n, k), dtype=torch.int8)
    scale = (torch.rand(n, groups) * 0.02).to(dtype)
    offset = (torch.randn(n, groups) * 0.1).to(dtype)
    setattr(linear, CHECKPOINT_INT8, (q, scale, offset))
    panel = PanelLinear(linear, weights="int8dp", group=group)
    assert panel.wtype == wtype_code("int8dp", group, offsets=True, half=dtype == torch.float16)
    assert panel.kernel_scale.dtype == dtype
    weight = dequantize(q, scale, group, offset)
    for m in (1, 2, 7, 8, 49):
        x = torch.randn(m, k)
        got = panel(x)
        want = F.linear(_inputs(x, "int8dp", group), weight, linear.bias)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * k ** 0.5)
        assert torch.equal(panel(x[m // 2:m // 2 + 1])[0], got[m // 2])  # batch of one
    assert torch.equal(panel.plain_weight(torch.float32), weight)


@needs_vnni
@torch.inference_mode()
def test_a_scale_per_group_follows_weights_whose_size_changes_along_k():
    """Where a row's weights are large in one part of k and small in the rest, one scale a
    row rounds the small ones away; a scale a group keeps them."""
    torch.manual_seed(3)
    linear = nn.Linear(512, 64, bias=False)
    linear.weight.data[:, :32] *= 100.0
    x = torch.randn(16, 512)
    x[:, :32] = 0.0  # what is left: the small weights' products
    exact = x @ linear.weight.detach().t()
    err = {g: (PanelLinear(linear, weights="int8dp", group=g)(x) - exact).abs().mean()
           for g in (0, 32)}
    assert err[32] < 0.05 * err[0]


@needs_vnni
async def test_engine_greedy_tokens_equal_the_plain_model_over_the_grouped_weights():
    reference = reference_model(_written_or_quantized({}), "int8dp", 32)
    # 11 tokens: the second prompt's 12th is a tie (its top two logits within 1e-4)
    expected = [hf_greedy(reference, p, 11) for p in PROMPTS]
    packed = make_tiny_model(seed=5)
    pack_linears(packed, layout="panels", weights="int8dp", group=32)
    core = EngineCore(EngineConfig(max_batch_size=8), model=packed)
    assert core.runner.fused is not None  # decode steps through the fused kernel
    outs, steps = await engine_greedy(core, PROMPTS, 11)
    assert steps < 11 * len(PROMPTS)
    assert outs == expected


def test_the_setting_names_the_group_and_refuses_what_the_kernel_cannot_take():
    assert [weight_group(w) for w in (None, "int8", "int8-g32", "int8-g2", "int8-g512")] == [
        0, 0, 32, 2, 512]
    for bad in ("int8-g3", "int8-g0", "int8-g1024", "int8-gx", "int4-g32", "int8-g"):
        with pytest.raises(ValueError, match="int8-g<N>' with N even, 2 to 512"):
            EngineConfig(weights=bad)
    with pytest.raises(ValueError, match="int8-g32 runs on the CPU"):
        EngineConfig(weights="int8-g32", device="cuda")
    with pytest.raises(ValueError, match="needs int8dp panels, not int8"):
        wtype_code("int8", 32)
    with pytest.raises(ValueError, match="do not fit weights"):  # a checkpoint's wrong scales
        linear = nn.Linear(64, 32)
        setattr(linear, CHECKPOINT_INT8, quantize_int8(linear.weight, 16))
        PanelLinear(linear, weights="int8dp", group=32)


@needs_vnni
def test_the_kernel_refuses_a_group_it_cannot_hold():
    lib = load_kernel()
    x, y, scale = torch.randn(2, 64), torch.empty(2, 32), torch.ones(2, 32)
    panels = torch.zeros(lib.panel_pair_elems(32, 64), dtype=torch.int8)

    def product(wtype: int) -> None:
        check(lib.panel_linear_w(x.data_ptr(), 2, 64, panels.data_ptr(), wtype,
                                 scale.data_ptr(), 32, None, y.data_ptr(), 1), "panel_linear_w")

    product(wtype_code("int8dp", 32))
    for wtype, named in ((wtype_code("bfloat16dp") | 32 << 8,
                          "a group on another kind than int8 pairs"),
                         (wtype_code("int8dp") | 3 << 8, "out of range"),
                         (wtype_code("int8dp") | 1024 << 8, "out of range")):
        with pytest.raises(KernelError, match=named):
            product(wtype)


def test_without_vnni_grouped_int8_is_served_as_bf16_and_the_plan_says_so(kept_to_avx2):
    dtype, kind, why = weight_plan(EngineConfig(weights="int8-g32"))
    assert (dtype, kind) == (torch.float32, "bfloat16")
    assert "instead of int8 with a scale per 32 of k, which needs AVX512-VNNI" in why
    assert weight_plan(EngineConfig(weights="int8"))[1] == "int8"  # per output: widened int8


@pytest.fixture(scope="module")
def grouped_checkpoint(tmp_path_factory, smollm_tokenizer):
    folder = tmp_path_factory.mktemp("w8a16-g32")
    return folder, write(make_tiny_model(seed=5), folder, "pack-quantized", smollm_tokenizer,
                         group=32)


@needs_vnni
async def test_a_grouped_checkpoint_is_served_with_its_own_integers_and_scales(
        grouped_checkpoint):
    folder, written = grouped_checkpoint
    core = EngineCore(EngineConfig(model=str(folder), max_batch_size=8))
    panels = {name: m for name, m in core.model.named_modules() if isinstance(m, PanelLinear)}
    assert weight_kind(core.model) == "int8dp-g32"
    assert "/float32+int8dp-g32/" in core.fingerprint  # a split's two sides must agree
    for name, (q, scale) in written.items():
        assert panels[name].group == 32 and torch.equal(panels[name].weight, q), name
        assert torch.equal(panels[name].weight_scale, scale), name
    # lm_head: not in the checkpoint, quantized at load
    reference = reference_model(_written_or_quantized(written), "int8dp", 32)
    expected = [hf_greedy(reference, p, 12) for p in PROMPTS]
    outs, _ = await engine_greedy(core, PROMPTS, 12)
    assert outs == expected


def test_without_vnni_a_grouped_checkpoint_is_dequantized_into_bf16_panels(
        grouped_checkpoint, kept_to_avx2, caplog):
    folder, written = grouped_checkpoint
    with caplog.at_level(logging.WARNING, logger="app.model_loader"):
        model = load_model(EngineConfig(model=str(folder)))
    assert "which needs AVX512-VNNI" in caplog.text
    assert weight_kind(model) == "bfloat16"
    assert not any(hasattr(m, CHECKPOINT_INT8) for m in model.modules())  # no int8 copies
    q, scale = written["model.layers.0.mlp.down_proj"]
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight,
                       dequantize(q, scale, 32).bfloat16())


def test_a_checkpoints_groups_must_agree_and_be_even():
    def qc(*sizes):
        groups = {f"group_{i}": {"targets": [f"t{i}"], "weights": {
            "num_bits": 8, "type": "int", "symmetric": True,
            "strategy": "group" if size else "channel", "group_size": size or None}}
            for i, size in enumerate(sizes)}
        return type("C", (), {"quantization_config": {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": groups}})()

    assert int8_format(qc(128)) == "pack-quantized"
    with pytest.raises(ModelLoadError, match=r"different scale groups \[0, 128\]"):
        int8_format(qc(128, 0))
    with pytest.raises(ModelLoadError, match="group_size 127"):
        int8_format(qc(127))


@needs_vnni
async def test_a_checkpoint_with_zero_points_is_served_with_its_offsets(tmp_path,
                                                                       smollm_tokenizer):
    """compressed-tensors ``(q - zero) * scale`` per group: the panels hold q, the scales and
    ``-zero * scale``, and the greedy tokens are the dequantized model's."""
    written = write(make_tiny_model(seed=5), tmp_path, "int-quantized", smollm_tokenizer,
                    group=32, asymmetric=True)
    core = EngineCore(EngineConfig(model=str(tmp_path), max_batch_size=8))
    assert weight_kind(core.model) == "int8dp-g32-offsets"
    panels = {name: m for name, m in core.model.named_modules() if isinstance(m, PanelLinear)}
    for name, (q, scale, offset) in written.items():
        assert torch.equal(panels[name].weight, q) and torch.equal(panels[name].weight_scale,
                                                                   scale), name
        assert torch.equal(panels[name].weight_offset, offset) and offset.any(), name
    assert not panels["lm_head"].weight_offset.any()  # quantized at load: offsets zero
    reference = reference_model(_written_or_quantized(written), "int8dp", 32)
    expected = [hf_greedy(reference, p, 11) for p in PROMPTS]
    outs, _ = await engine_greedy(core, PROMPTS, 11)
    assert outs == expected
