"""Linear weights copied into a kernel's layout (oneDNN's, or the engine's own panels): same
model, same tokens; oneDNN's one-row products exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.config import EngineConfig, KernelConfig
from app.cpu_kernels import kernel_unavailable
from app.engine_core import EngineCore
from app.fingerprint import fingerprint
from app.packed_linear import PackedLinear, PanelLinear, pack_linears, packing_unavailable
from tests.conftest import engine_greedy, hf_greedy, make_tiny_model

pytestmark = pytest.mark.skipif(packing_unavailable(make_tiny_model(), "onednn") is not None,
                                reason="torch built without oneDNN")
LAYOUTS = ["onednn", pytest.param("panels", marks=pytest.mark.skipif(
    packing_unavailable(make_tiny_model(), "panels") is not None,
    reason="the panel kernel needs x86-64 with AVX2/FMA and a C compiler"))]
KIND = {"onednn": PackedLinear, "panels": PanelLinear}

PROMPTS = [[5, 9, 13, 200, 7], [300, 41, 8], list(range(100, 140)), [77] * 12]


def _linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear | PackedLinear | PanelLinear)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pack_swaps_every_linear_and_keeps_the_model(layout):
    model = make_tiny_model(seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    print_before = fingerprint(model)
    names = _linears(model)
    assert pack_linears(model, layout=layout) == len(names) == 2 * 7 + 1  # 7 per layer + head
    assert all(isinstance(model.get_submodule(n), KIND[layout]) for n in names)
    after = model.state_dict()
    assert after.keys() == before.keys()  # the reordered copies are not state
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert fingerprint(model) == print_before  # KV stays exchangeable with unpacked peers
    # the tied LM head still shares the embedding's weight
    assert model.lm_head.weight is model.model.embed_tokens.weight


@torch.inference_mode()
def test_one_row_is_exact_and_more_rows_are_close():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True)
    packed = PackedLinear(linear)
    one = torch.randn(1, 1, 64)
    assert torch.equal(packed(one), linear(one))
    many = torch.randn(8, 1, 64)
    torch.testing.assert_close(packed(many), linear(many), rtol=1e-4, atol=1e-4)
    prompt = torch.randn(2, 33, 64)[:, ::2]  # a non-contiguous input too
    torch.testing.assert_close(packed(prompt), linear(prompt), rtol=1e-4, atol=1e-4)


def test_refuses_what_it_cannot_pack():
    model = make_tiny_model().to(torch.bfloat16)
    assert packing_unavailable(model) == "the model is not float32"
    with pytest.raises(ValueError, match="not float32"):
        pack_linears(model)


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_packed_engine_gives_the_plain_models_greedy_tokens(layout):
    """Prefill (many rows) and batched decode run the copied weights; the greedy tokens
    of a batch equal the plain model's generate(), each prompt alone."""
    plain = make_tiny_model(seed=5)
    expected = [hf_greedy(plain, p, 12) for p in PROMPTS]
    packed = make_tiny_model(seed=5)
    pack_linears(packed, layout=layout)
    core = EngineCore(EngineConfig(max_batch_size=8), model=packed)
    outs, steps = await engine_greedy(core, PROMPTS, 12)
    assert steps < 12 * len(PROMPTS)  # the rows shared steps
    assert outs == expected


@pytest.mark.smollm
async def test_smollm_on_the_default_layout_gives_the_plain_models_greedy_tokens(
        smollm_config, smollm_model, smollm_tokenizer):
    """SmolLM2 as the app loads it (linears in the default layout, batched decode) against
    the same weights with plain ``nn.Linear`` layers, each prompt alone through generate()."""
    from dataclasses import replace

    from app.model_loader import load_model

    plain = load_model(replace(smollm_config, kernels=KernelConfig(linear="torch")))
    assert not any(isinstance(m, PackedLinear | PanelLinear) for m in plain.modules())
    assert any(isinstance(m, PackedLinear | PanelLinear) for m in smollm_model.modules())
    prompts = [smollm_tokenizer.encode(t) for t in (
        "The capital of France is", "def fibonacci(n):", "List three primary colors:",
        "Water boils at")]
    expected = [hf_greedy(plain, p, 16) for p in prompts]
    core = EngineCore(EngineConfig(max_batch_size=8), model=smollm_model)
    # panels where the kernel builds: then each step is one call to the fused kernel
    assert (core.runner.fused is not None) is (kernel_unavailable() is None)
    outs, steps = await engine_greedy(core, prompts, 16)
    assert steps < 16 * len(prompts)  # the rows shared steps
    assert outs == expected
