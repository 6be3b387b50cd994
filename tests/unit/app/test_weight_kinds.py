"""Linear weights held as bf16 or int8 in the engine's panels (app.packed_linear): the kernel
computes what the rounded weights compute, a row's result does not depend on its batch, and
the engine's greedy tokens (prefill, batched and fused decode) equal the plain model's over
the same rounded weights; the config decides the kind (dtype, weights, auto)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.config import EngineConfig, resolve_dtype
from app.cpu_kernels import kernel_unavailable, load_kernel
from app.engine_core import EngineCore
from app.fingerprint import fingerprint
from app.packed_linear import PanelLinear, pack_linears, quantize_int8, weight_kind, weight_plan
from tests.conftest import engine_greedy, hf_greedy, make_tiny_model

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason="the panel kernel needs x86-64 with AVX2/FMA and a compiler")


def _native_bf16() -> bool:
    return kernel_unavailable() is None and bool(load_kernel().panel_has_avx512bf16())


def _vnni() -> bool:
    return kernel_unavailable() is None and bool(load_kernel().panel_has_avx512vnni())


KINDS = ["bfloat16", "int8", pytest.param("bfloat16dp", marks=pytest.mark.skipif(
    not _native_bf16(), reason="the CPU has no AVX512-BF16 (bfloat16dp needs vdpbf16ps)")),
    pytest.param("int8dp", marks=pytest.mark.skipif(
        not _vnni(), reason="the CPU has no AVX512-VNNI (int8dp needs vpdpwssd)"))]
PROMPTS = [[5, 9, 13, 200, 7], [300, 41, 8], list(range(100, 140)), [77] * 12]


def _rounded(linear: nn.Linear, kind: str) -> torch.Tensor:
    """The weight the kind's panels hold, as float32."""
    if kind in ("int8", "int8dp"):
        q, scale = quantize_int8(linear.weight)
        return q.float() * scale[:, None]
    return linear.weight.detach().bfloat16().float()


def _inputs(x: torch.Tensor, kind: str, block: int = 256) -> torch.Tensor:
    """What ``kind``'s products take of an input: bfloat16dp rounds it to bf16; int8dp to
    16-bit integers over each row's blocks of ``block`` (256; grouped weights': the group),
    scaled by the block's largest magnitude."""
    if kind == "bfloat16dp":
        return x.bfloat16().float()
    if kind != "int8dp":
        return x
    out = x.clone()
    for k0 in range(0, x.shape[-1], block):
        block_x = x[..., k0:k0 + block]
        amax = block_x.abs().amax(dim=-1, keepdim=True)
        scale = amax / 32767.0
        inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))
        out[..., k0:k0 + block] = torch.round(block_x * inv) * scale
    return out


def reference_model(weight_of, kind: str, block: int = 256, seed: int = 5) -> nn.Module:
    """The tiny model in float32 (its head untied) with every linear computing what
    ``kind``'s panels do: its weight ``weight_of(name, linear)``, and for bfloat16dp / int8dp
    its input as their products take it (:func:`_inputs`, int8dp's blocks of ``block``)."""
    model = make_tiny_model(seed=seed)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # untie
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            module.weight.data = weight_of(name, module)
            if kind in ("bfloat16dp", "int8dp"):
                module.register_forward_pre_hook(lambda _m, a: (_inputs(a[0], kind, block),))
    return model


def _reference(kind: str, seed: int) -> nn.Module:
    """The tiny model with each linear's weight rounded as ``kind``'s panels round it."""
    return reference_model(lambda _name, linear: _rounded(linear, kind), kind, seed=seed)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("avx512", [1, 0])
@torch.inference_mode()
def test_a_product_is_the_rounded_weights_and_the_same_in_any_batch(kind, avx512):
    lib = load_kernel()
    lib.panel_set_avx512(avx512)
    try:
        torch.manual_seed(1)
        for n, k in ((96, 64), (100, 71), (576, 576)):
            linear = nn.Linear(k, n)
            panel = PanelLinear(linear, weights=kind)
            assert panel.panels.element_size() == (1 if kind.startswith("int8") else 2)
            for m in (1, 2, 3, 5, 7, 8, 13, 49, 130):
                x = torch.randn(m, k)
                want = F.linear(_inputs(x, kind), _rounded(linear, kind), linear.bias)
                got = panel(x)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * k ** 0.5)
                assert torch.equal(panel(x[m // 2:m // 2 + 1])[0], got[m // 2])  # batch of one
    finally:
        lib.panel_set_avx512(1)


@pytest.mark.skipif(not _vnni(), reason="the CPU has no AVX512-VNNI")
@torch.inference_mode()
def test_int8dp_inputs_scaled_per_block_keep_zeros_and_non_finite_values():
    """A block's scale comes from its own largest input (a huge input in one block leaves the
    others' precision alone), an all-zero row gives the bias, a non-finite input NaN."""
    torch.manual_seed(2)
    linear = nn.Linear(600, 40)
    panel = PanelLinear(linear, weights="int8dp")
    x = torch.randn(4, 600)
    x[1, 3] = 1e6  # the first block of row 1 only
    x[2] = 0.0
    x[3, 500] = float("inf")
    got = panel(x)
    ref = F.linear(x[:2], _rounded(linear, "int8dp"), linear.bias)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-3)
    big = got[1] - ref[1]  # the huge block's error stays within its own 15 bits
    assert big.abs().max() < 1e6 / 32767 * 40
    assert torch.equal(got[2], linear.bias.detach())
    assert got[3].isnan().all() and not got[:3].isnan().any()


@pytest.mark.parametrize("kind", KINDS)
async def test_engine_greedy_tokens_equal_the_rounded_plain_model(kind):
    expected = [hf_greedy(_reference(kind, 5), p, 12) for p in PROMPTS]
    packed = make_tiny_model(seed=5)
    pack_linears(packed, layout="panels", weights=kind)
    assert weight_kind(packed) == kind
    assert packed.lm_head.weight is packed.model.embed_tokens.weight  # tied: kept as it was
    core = EngineCore(EngineConfig(max_batch_size=8), model=packed)
    assert core.runner.fused is not None  # decode steps through the fused kernel
    outs, steps = await engine_greedy(core, PROMPTS, 12)
    assert steps < 12 * len(PROMPTS)
    assert outs == expected


def test_panels_drop_the_float32_weights_and_the_fingerprint_says_the_kind():
    model = make_tiny_model(seed=3)
    plain = fingerprint(model)
    pack_linears(model, layout="panels", weights="int8")
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == torch.int8 and q_proj.weight_scale.shape == (64,)
    assert "model.layers.0.self_attn.q_proj.weight_scale" in model.state_dict()
    assert fingerprint(model).dtype == "float32+int8" != plain.dtype
    model = make_tiny_model(seed=3)
    pack_linears(model, layout="panels", weights="bfloat16")
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert fingerprint(model).dtype == "float32+bfloat16"


def test_config_decides_the_dtype_and_the_panels(monkeypatch):
    import app.config as config

    monkeypatch.delenv(config.KERNEL_ISA_ENV, raising=False)
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu")[0] == "bfloat16"
    assert EngineConfig(dtype="auto").torch_kv_dtype == torch.bfloat16
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") == ("float32", "auto: the CPU has no native bf16 "
                                                       "products (no avx512_bf16)")
    assert resolve_dtype("auto", "cuda")[0] == "bfloat16"
    assert resolve_dtype("float32", "cpu")[0] == "float32"


def test_kept_to_avx2_auto_chooses_float32_and_a_bad_value_is_named(monkeypatch):
    """``SPLITSERVE_KERNEL_ISA=avx2`` decides ``auto`` as an AVX2-only CPU would, whatever
    this one has; a value it does not know raises, naming the variable."""
    import app.config as config

    monkeypatch.setattr(config, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    monkeypatch.delenv(config.KERNEL_ISA_ENV, raising=False)
    assert resolve_dtype("auto", "cpu")[0] == "bfloat16"
    monkeypatch.setenv(config.KERNEL_ISA_ENV, "AVX2")
    assert config.kernel_isa() == "avx2" and not config.cpu_has_native_bf16()
    assert resolve_dtype("auto", "cpu") == (
        "float32", "auto: the engine is kept to AVX2 (SPLITSERVE_KERNEL_ISA=avx2)")
    monkeypatch.setenv(config.KERNEL_ISA_ENV, "avx10")
    with pytest.raises(ValueError, match="SPLITSERVE_KERNEL_ISA='avx10'"):
        config.kernel_isa()
    monkeypatch.setenv(config.KERNEL_ISA_ENV, "native")
    assert config.kernel_isa() == "native" and config.cpu_has_native_bf16()


def test_weight_plan_takes_the_kind_the_cpu_has_and_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="weights must be None, 'int8', 'gguf' or 'int8-g<N>'"):
        EngineConfig(weights="int4")
    with pytest.raises(ValueError, match="int8 runs on the CPU"):
        EngineConfig(weights="int8", device="cuda")
    dtype, kind, _ = weight_plan(EngineConfig(dtype="bfloat16"))
    assert dtype == torch.float32
    assert kind == ("bfloat16dp" if _native_bf16() else "bfloat16")
    assert weight_plan(EngineConfig(weights="int8"))[:2] == (
        torch.float32, "int8dp" if _vnni() else "int8")
    assert weight_plan(EngineConfig())[:2] == (torch.float32, None)
    # where the panels are not to be had, bf16 runs in torch and int8 is refused
    dtype, kind, why = weight_plan(EngineConfig(dtype="bfloat16", kernels={"linear": "torch"}))
    assert (dtype, kind) == (torch.bfloat16, None) and "kernels.linear is torch" in why
    with pytest.raises(ValueError, match="int8 needs the engine's panel kernel"):
        weight_plan(EngineConfig(weights="int8", kernels={"linear": "onednn"}))
