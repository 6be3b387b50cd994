"""A checkpoint that already holds int8 weights (compressed-tensors W8A16,
app.quantized_checkpoint): the engine serves its own integers and scales through the int8
panels, quantizing nothing again, and refuses a scheme the panels cannot hold with what it
found.

The checkpoints are written by load_tests.int8_checkpoint as the format documents them (and
as compressed-tensors 0.20.1's own pack_to_int32 and decompressor read them, checked once:
docs/benchmarks/results/2026-12-07-int8-checkpoint/): llm-compressor's min-max symmetric
scales (largest magnitude / 127.5, integers in [-128, 127]), which the engine's own
per-channel quantizer (/ 127) would not give, so a re-quantized weight would show."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from app.config import EngineConfig
from app.engine_core import EngineCore
from app.errors import ModelLoadError
from app.model_loader import load_model
from app.packed_linear import PanelLinear, quantize_int8, weight_kind, weight_plan
from app.quantized_checkpoint import CHECKPOINT_INT8, dequantize, int8_format, unpack_int32
from load_tests.int8_checkpoint import GROUP, pack, write
from tests.conftest import engine_greedy, hf_greedy, make_tiny_model
from tests.unit.app.test_weight_kinds import PROMPTS, reference_model


@pytest.fixture(scope="module", params=["pack-quantized", "int-quantized"])
def checkpoint(request, tmp_path_factory, smollm_tokenizer):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, write(make_tiny_model(seed=5), folder, request.param, smollm_tokenizer)


def test_unpacking_follows_the_documented_words():
    q = torch.tensor([[1, -2, 127, -128, 5]], dtype=torch.int8)
    words = pack(q)
    assert words.tolist() == [[129 | 126 << 8 | 255 << 16, 133]]
    assert torch.equal(unpack_int32(words, (1, 5)), q)
    with pytest.raises(ModelLoadError, match="does not hold"):
        unpack_int32(words, (2, 5))


def test_the_panels_hold_the_checkpoints_own_integers(checkpoint):
    folder, written = checkpoint
    model = load_model(EngineConfig(model=str(folder)))  # weights unset: the checkpoint's
    assert weight_kind(model) in ("int8", "int8dp")
    panels = {name: m for name, m in model.named_modules() if isinstance(m, PanelLinear)}
    assert set(written) < set(panels)  # and lm_head, quantized at load as weights: int8 does
    requantized_differs = False
    for name, (q, scale) in written.items():
        assert torch.equal(panels[name].weight, q), name
        assert torch.equal(panels[name].weight_scale, scale), name
        requantized_differs |= not torch.equal(quantize_int8(q.float() * scale[:, None])[0], q)
    assert requantized_differs  # what this test would see had the loader quantized again


async def test_engine_greedy_tokens_equal_the_dequantized_plain_model(checkpoint):
    folder, written = checkpoint
    core = EngineCore(EngineConfig(model=str(folder), max_batch_size=8))
    reference = reference_model(
        lambda name, linear: dequantize(*(written.get(name) or quantize_int8(linear.weight))),
        weight_kind(core.model))
    expected = [hf_greedy(reference, p, 12) for p in PROMPTS]
    outs, _ = await engine_greedy(core, PROMPTS, 12)
    assert outs == expected


def test_without_the_kernel_the_checkpoint_is_dequantized(checkpoint):
    folder, written = checkpoint
    config = EngineConfig(model=str(folder), kernels={"linear": "torch"})
    assert weight_plan(config, int8_checkpoint=True)[1] is None
    model = load_model(config)
    q, scale = written["model.layers.0.mlp.down_proj"]
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, q.float() * scale[:, None])
    assert not any(hasattr(m, CHECKPOINT_INT8) for m in model.modules())  # no int8 copies held
    with pytest.raises(ValueError, match="int8 needs the engine's panel kernel"):
        weight_plan(EngineConfig(weights="int8", kernels={"linear": "torch"}),
                    int8_checkpoint=True)


@pytest.mark.parametrize(("change", "named"), [
    ({"weights": {"num_bits": 4}}, "weights of 4 bits"),
    ({"weights": {"strategy": "block", "group_size": 128}}, "strategy 'block'"),
    ({"weights": {"strategy": "group", "group_size": 1024}}, "group_size 1024"),
    ({"weights": {"symmetric": False}}, "asymmetric"),
    ({"weights": {"actorder": "group"}}, "activation order"),
    ({"input_activations": {"num_bits": 8, "type": "int"}}, "quantized activations"),
    ({"format": "float-quantized"}, "format 'float-quantized'"),
    ({"quantization_status": "frozen"}, "quantization_status 'frozen'"),
])
def test_a_scheme_the_panels_cannot_hold_is_refused_with_what_was_found(change, named):
    group = json.loads(json.dumps(GROUP))
    group["weights"].update(change.get("weights", {}))
    if "input_activations" in change:
        group["input_activations"] = change["input_activations"]
    qc = {"quant_method": "compressed-tensors", "format": change.get("format", "pack-quantized"),
          "quantization_status": change.get("quantization_status", "compressed"),
          "config_groups": {"group_0": group}}
    with pytest.raises(ModelLoadError, match="W8A16") as info:
        int8_format(SimpleNamespace(quantization_config=qc))
    assert named in str(info.value)
    assert int8_format(SimpleNamespace(quantization_config=None)) is None
    assert int8_format(SimpleNamespace(quantization_config={"quant_method": "gptq"})) is None


def test_a_refused_checkpoint_fails_the_load_clearly(tmp_path):
    write(make_tiny_model(seed=1), tmp_path, "pack-quantized", num_bits=4)
    with pytest.raises(ModelLoadError, match="weights of 4 bits"):
        load_model(EngineConfig(model=str(tmp_path)))


def test_a_hub_id_is_fetched_with_only_its_configs_and_safetensors(checkpoint, monkeypatch):
    import huggingface_hub
    from transformers import AutoConfig

    from app.quantized_checkpoint import load_int8_checkpoint

    folder, written = checkpoint
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kw: asked.append((repo, kw)) or str(folder))
    model = load_int8_checkpoint("org/w8a16", AutoConfig.from_pretrained(folder))
    assert asked == [("org/w8a16", {"allow_patterns": ["*.json", "*.safetensors"]})]
    q, _ = written["model.layers.1.self_attn.o_proj"]
    assert torch.equal(getattr(model.model.layers[1].self_attn.o_proj, CHECKPOINT_INT8)[0], q)


def test_a_broken_checkpoint_says_what_is_wrong(tmp_path):
    from safetensors.torch import load_file, save_file

    write(make_tiny_model(seed=1), tmp_path, "pack-quantized")
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.up_proj.weight_shape"]
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match="up_proj has a weight_scale but no"):
        load_model(EngineConfig(model=str(tmp_path)))
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    with pytest.raises(ModelLoadError, match=r"could not read .*model\.safetensors"):
        load_model(EngineConfig(model=str(tmp_path)))
