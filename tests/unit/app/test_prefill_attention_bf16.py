"""Prefill attention with bf16 products (app/csrc/prefill_attention_bf16.c): on a CPU with
AVX512-BF16, SDPA's attention under the same masks over the bf16-rounded inputs, a padded
past never read, the runner taking it exactly when it serves bf16 dot-product panels, and
a clear refusal on a CPU without the instructions."""

from __future__ import annotations

import pytest
import torch

from app import cpu_kernels
from app.config import EngineConfig
from app.model_runner import ModelRunner
from app.packed_linear import pack_linears
from app.prefill_attention import _kernel_prefill_attention, bf16_attention_unavailable
from tests.conftest import make_tiny_model
from tests.unit.app.test_prefill_attention import _reference

_REASON = cpu_kernels.cpu_unsupported() or cpu_kernels.kernel_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
HAS_BF16 = _REASON is None and bool(cpu_kernels.load_kernel().panel_has_avx512bf16())
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="the CPU lacks AVX512-BF16")


def _bf16(*ts):
    return [t.to(torch.bfloat16).float() for t in ts]


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(64, 9, 3), (16, 4, 2), (48, 2, 2),
                                                             (128, 2, 1)])
@pytest.mark.parametrize(("seq", "starts"), [(1, [0]), (13, [0]), (100, [0]), (29, [37]),
                                             (12, [20, 0, 37]), (70, [16, 16])])
@torch.inference_mode()
def test_bf16_products_give_sdpa_over_the_rounded_inputs(threads, head_dim, heads, kv_heads,
                                                         seq, starts):
    """Against SDPA in float32 over q, k, v rounded to bf16: what is left is the
    probabilities' rounding to bf16 (a relative error of at most 2^-9 each)."""
    torch.manual_seed(seq * 7 + head_dim)
    bsz, pmax = len(starts), max(starts)
    q = torch.randn(bsz, seq, heads, head_dim).transpose(1, 2)
    k = torch.randn(bsz, kv_heads, pmax + seq, head_dim)
    v = torch.randn(bsz, kv_heads, pmax + seq, head_dim)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _kernel_prefill_attention(q, k, v, torch.tensor(starts), pmax, None, bf16=True)
    finally:
        torch.set_num_threads(before)
    reference = _reference(*_bf16(q, k, v), starts, pmax, head_dim ** -0.5)
    assert out.shape == (bsz, seq, heads, head_dim)
    torch.testing.assert_close(out, reference, rtol=2e-2, atol=1e-2)
    rel = (out - reference).norm() / reference.norm()
    assert rel < 4e-3, rel


@needs_bf16
@pytest.mark.parametrize("ramp", [(0.2, 4.0), (4.0, 0.2)])
@torch.inference_mode()
def test_scores_that_grow_or_fall_across_steps(ramp):
    """Keys whose size grows along the prompt raise a row's max at nearly every 64-key step
    (its earlier sums rescaled each time); keys that shrink leave it where the first step
    put it (the steps that compare and keep it). Both are SDPA's answer."""
    torch.manual_seed(3)
    seq, heads, kv_heads, hd = 300, 4, 2, 64
    q = torch.randn(1, heads, seq, hd)
    size = torch.linspace(*ramp, seq).view(1, 1, seq, 1)
    k, v = torch.randn(1, kv_heads, seq, hd) * size, torch.randn(1, kv_heads, seq, hd)
    out = _kernel_prefill_attention(q, k, v, torch.tensor([0]), 0, None, bf16=True)
    reference = _reference(*_bf16(q, k, v), [0], 0, hd ** -0.5)
    rel = (out - reference).norm() / reference.norm()
    assert rel < 4e-3, rel


@needs_bf16
@torch.inference_mode()
def test_the_padded_past_is_never_read_with_bf16_products():
    torch.manual_seed(1)
    q = torch.randn(2, 4, 9, 16)
    k, v = torch.randn(2, 2, 46, 16), torch.randn(2, 2, 46, 16)
    clean = _kernel_prefill_attention(q, k, v, torch.tensor([5, 37]), 37, None, bf16=True)
    k[0, :, 5:37] = float("nan")
    v[0, :, 5:37] = float("nan")
    dirty = _kernel_prefill_attention(q, k, v, torch.tensor([5, 37]), 37, None, bf16=True)
    assert torch.equal(clean, dirty)


def _runner(weights: str) -> ModelRunner:
    model = make_tiny_model(seed=8)
    pack_linears(model, layout="panels", weights=weights)
    return ModelRunner(model, EngineConfig())


@needs_bf16
@torch.inference_mode()
def test_a_runner_serving_bf16_dot_product_panels_attends_with_bf16_products():
    bf16, fp32 = _runner("bfloat16dp"), _runner("float32")
    assert bf16.prefill_bf16 and not fp32.prefill_bf16
    assert bf16.kernel_paths()["prefill_attention"] == "kernel_bf16"
    assert fp32.kernel_paths()["prefill_attention"] == "kernel"
    prompts = [list(range(3, 80)), [5, 9, 33]]
    (la, kva), (lb, kvb) = bf16.forward_prefill(prompts), fp32.forward_prefill(prompts)
    # bf16 weights and attention against float32: close, not equal
    assert not torch.equal(la, lb)
    torch.testing.assert_close(la, lb, rtol=0.1, atol=0.3)
    for a, b in zip(kva, kvb, strict=True):  # the KV: within a few bf16 roundings overall
        assert ((a - b).norm() / b.norm()).item() < 0.02


def test_only_bf16_dot_product_panels_take_bf16_attention():
    assert bf16_attention_unavailable("bfloat16dp") is None
    for weights in ("float32", "bfloat16", "int8dp", None):
        assert "not bf16 dot-product panels" in bf16_attention_unavailable(weights)


@pytest.mark.skipif(HAS_BF16, reason="the refusal is for a CPU without AVX512-BF16")
def test_a_cpu_without_bf16_products_refuses_the_bf16_kernel():
    q = k = v = torch.zeros(1, 2, 4, 16)
    with pytest.raises(cpu_kernels.KernelError, match="prefill_attention_bf16"):
        _kernel_prefill_attention(q, k, v, torch.tensor([0]), 0, None, bf16=True)
