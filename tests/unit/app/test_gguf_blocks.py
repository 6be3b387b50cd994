"""``weights: gguf`` (app.gguf_blocks): a GGUF model's own Q8_0 / Q4_0 / Q4_1 blocks in int8
panels with a scale (and an offset) per 32 of k. The blocks decode to exactly what gguf's own
dequantizer gives; the default model's panels hold its file's integers, its greedy tokens
equal the float32 model's (every product's inputs rounded as the int8 kernel takes them);
what cannot be served so is refused naming why, and without AVX512-VNNI it is bf16 panels."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from app.config import EngineConfig
from app.cpu_kernels import kernel_unavailable
from app.engine_core import EngineCore
from app.errors import ModelLoadError
from app.gguf_blocks import attach_gguf_blocks, decode
from app.model_loader import embedded_gguf_path, load_model
from app.packed_linear import PanelLinear, weight_kind, weight_plan
from app.quantized_checkpoint import CHECKPOINT_INT8
from tests.conftest import engine_greedy, hf_greedy, make_tiny_model
from tests.unit.app.test_int8_groups import kept_to_avx2  # noqa: F401 (a fixture)
from tests.unit.app.test_weight_kinds import _inputs, _vnni

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason="the panel kernel needs x86-64 with AVX2/FMA and a compiler")
needs_vnni = pytest.mark.skipif(not _vnni(), reason="the CPU has no AVX512-VNNI (or is kept "
                                "to AVX2): weights: gguf is served as bf16 there, tested below")


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_blocks_decode_to_what_ggufs_own_dequantizer_gives(kind):
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    w = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    w[:, :32] += 3.0  # a block whose minimum is far from zero (Q4_1's offset)
    raw = quants.quantize(w, qtype)
    want = torch.from_numpy(quants.dequantize(raw, qtype))
    q, scale, offset = decode(kind, raw, 24, 96)
    assert q.dtype == torch.int8 and scale.shape == (24, 3)
    assert (offset is not None) == (kind == "Q4_1")
    got = q.float() * scale.repeat_interleave(32, dim=1)
    if offset is not None:
        got = got + offset.repeat_interleave(32, dim=1)
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def gguf_model():
    return load_model(EngineConfig(weights="gguf"))


@needs_vnni
@pytest.mark.smollm
def test_the_default_models_panels_hold_its_files_own_blocks(gguf_model, smollm_model):
    from gguf import GGUFReader

    assert weight_kind(gguf_model) == "int8dp-g32-offsets"
    down = gguf_model.model.layers[2].mlp.down_proj
    assert isinstance(down, PanelLinear) and down.group == 32
    raw = next(t for t in GGUFReader(str(embedded_gguf_path())).tensors
               if t.name == "blk.2.ffn_down.weight")
    q, scale, offset = decode("Q4_1", raw.data, down.out_features, down.in_features)
    assert torch.equal(down.weight, q) and torch.equal(down.weight_scale, scale)
    assert torch.equal(down.weight_offset, offset)
    assert int(q.min()) >= 0 and int(q.max()) <= 15  # the file's nibbles, not requantized
    head = gguf_model.lm_head  # tied: the embedding's Q8_0 blocks, offsets zero
    assert head.weight is gguf_model.model.embed_tokens.weight
    assert not head.weight_offset.any()
    # the blocks are the float32 model's weights: its q rows back in order too
    ref_w = smollm_model.model.layers[0].self_attn.q_proj.weight.detach()
    got_q = gguf_model.model.layers[0].self_attn.q_proj.plain_weight(torch.float32)
    assert torch.allclose(got_q, ref_w.float(), rtol=0, atol=1e-6 * float(ref_w.abs().max()))


@needs_vnni
@pytest.mark.smollm
async def test_greedy_tokens_equal_the_float32_model_with_the_kernels_inputs(
        smollm_tokenizer):
    reference = load_model(EngineConfig(kernels={"linear": "torch"}))
    for module in reference.modules():
        if type(module) is nn.Linear:
            module.register_forward_pre_hook(lambda _m, a: (_inputs(a[0], "int8dp", 32),))
    prompts = [smollm_tokenizer.encode(p) for p in
               ("The capital of France is", "def add(a, b):", "Water boils at")]
    expected = [hf_greedy(reference, p, 8) for p in prompts]
    core = EngineCore(EngineConfig(weights="gguf", max_batch_size=4))
    assert core.runner.fused is not None
    outs, _ = await engine_greedy(core, prompts, 8)
    assert outs == expected


def test_what_cannot_be_served_from_blocks_is_refused(tmp_path, monkeypatch):
    make_tiny_model(seed=1).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"is not a \.gguf file"):
        load_model(EngineConfig(model=str(tmp_path), weights="gguf"))

    import gguf

    model = make_tiny_model(seed=1)
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    gguf_names = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj"}

    def reader(arch: str, kind: str, every: bool = False):
        names = {f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}" for i in range(2)
                 for g, h in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                              ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                              ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                              ("ffn_down", "mlp.down_proj"))} if every else gguf_names
        names = {**names, "token_embd.weight": "lm_head"} if every else names
        tensors = [SimpleNamespace(name=g, tensor_type=SimpleNamespace(name=kind),
                                   data=np.zeros((linears[h].out_features,
                                                  linears[h].in_features // 32 * 34),
                                                 dtype=np.uint8)) for g, h in names.items()]
        field = SimpleNamespace(parts=[np.frombuffer(arch.encode(), dtype=np.uint8)], data=[0])
        return lambda _path: SimpleNamespace(fields={"general.architecture": field},
                                             tensors=tensors)

    monkeypatch.setattr(gguf, "GGUFReader", reader("qwen2", "Q8_0"))
    with pytest.raises(ModelLoadError, match=r"reads llama GGUF files, x\.gguf is qwen2"):
        attach_gguf_blocks(model, tmp_path / "x.gguf")
    monkeypatch.setattr(gguf, "GGUFReader", reader("llama", "Q6_K"))
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.weight is Q6_K"):
        attach_gguf_blocks(model, tmp_path / "x.gguf")
    monkeypatch.setattr(gguf, "GGUFReader", reader("llama", "Q8_0"))  # one linear's only
    with pytest.raises(ModelLoadError, match="no blocks for"):
        attach_gguf_blocks(model, tmp_path / "x.gguf")
    monkeypatch.setattr(gguf, "GGUFReader", reader("llama", "Q8_0", every=True))  # all zero
    with pytest.raises(ModelLoadError, match="blocks do not give its weight"):
        attach_gguf_blocks(model, tmp_path / "x.gguf")
    assert not any(hasattr(m, CHECKPOINT_INT8) for m in model.modules())


@pytest.mark.smollm
def test_without_vnni_weights_gguf_is_served_as_bf16_panels(kept_to_avx2, caplog):  # noqa: F811
    dtype, kind, why = weight_plan(EngineConfig(weights="gguf"))
    assert (dtype, kind) == (torch.float32, "bfloat16")
    assert "which needs AVX512-VNNI" in why
    with caplog.at_level(logging.WARNING, logger="app.model_loader"):
        model = load_model(EngineConfig(weights="gguf"))
    assert "instead of int8" in caplog.text
    assert weight_kind(model) == "bfloat16"
    assert not any(hasattr(m, CHECKPOINT_INT8) for m in model.modules())
