"""EngineConfig: defaults, dtype helpers and validation on construction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.config import DEFAULT_MODEL, EngineConfig, default_cache_dir, dtype_name, parse_dtype


def test_defaults_are_valid_and_resolve():
    cfg = EngineConfig()
    assert cfg.model == DEFAULT_MODEL
    assert cfg.torch_dtype is torch.float32
    assert cfg.torch_kv_dtype is torch.float32  # kv_dtype None: same as dtype
    assert EngineConfig(dtype="bfloat16").torch_kv_dtype is torch.bfloat16
    assert EngineConfig(kv_dtype="bfloat16").torch_kv_dtype is torch.bfloat16
    assert EngineConfig(device="cuda:1", dtype="float16").torch_dtype is torch.float16


def test_dtype_names_round_trip():
    for name in ("float32", "bfloat16", "float16"):
        assert dtype_name(parse_dtype(name)) == name
    with pytest.raises(ValueError, match="unsupported dtype"):
        dtype_name(torch.int8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "float64"}, "unknown dtype 'float64'"),
        ({"dtype": "fp32"}, "unknown dtype"),
        ({"kv_dtype": "int8"}, "unknown dtype 'int8'"),
        ({"device": "tpu"}, "device must be 'cpu' or 'cuda"),
        ({"device": "mps"}, "device must be"),
        ({"dtype": "float16"}, "float16 is not supported on cpu"),
        ({"num_threads": 0}, "num_threads must be >= 1"),
        ({"decode_threads": 0}, "decode_threads must be >= 1"),
        ({"max_batch_size": 0}, "max_batch_size must be >= 1"),
        ({"max_kv_tokens": 0}, "max_kv_tokens must be >= 1"),
        ({"max_waiting": -1}, "max_waiting must be >= 1"),
        ({"prefill_token_budget": 0}, "prefill_token_budget must be >= 1"),
        ({"prefill_max_batch_size": 0}, "prefill_max_batch_size must be >= 1"),
        ({"max_model_len": 1}, "max_model_len must be >= 2"),
        ({"num_gpus": 0}, "num_gpus must be >= 1"),
        ({"device_map": "auto"}, "needs device 'cuda'"),
        ({"device": "cuda:1", "device_map": "auto"}, "needs device 'cuda' \\(no index\\)"),
        ({"device": "cuda", "device_map": "everywhere"}, "device_map must be one of"),
    ],
)
def test_invalid_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_boundary_values_accepted():
    cfg = EngineConfig(num_threads=1, max_batch_size=1, max_kv_tokens=1, max_waiting=1,
                       prefill_token_budget=1, prefill_max_batch_size=1, max_model_len=2)
    assert cfg.max_model_len == 2 and cfg.num_threads == 1


def test_config_is_frozen():
    cfg = EngineConfig()
    with pytest.raises(AttributeError):
        cfg.max_batch_size = 3  # type: ignore[misc]


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "env"))
    assert default_cache_dir() == tmp_path / "env"
    assert EngineConfig().resolved_cache_dir == tmp_path / "env"
    assert EngineConfig(cache_dir=str(tmp_path / "x")).resolved_cache_dir == tmp_path / "x"
    monkeypatch.delenv("SPLITSERVE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "splitserve"


def test_gpu_settings_validate_without_a_gpu():
    cfg = EngineConfig(device="cuda", dtype="bfloat16")
    assert cfg.torch_dtype is torch.bfloat16 and cfg.torch_kv_dtype is torch.bfloat16
    assert cfg.device_map is None and cfg.num_gpus == 1
    spread = EngineConfig(device="cuda", dtype="bfloat16", device_map="auto", num_gpus=4)
    assert spread.device_map == "auto" and spread.num_gpus == 4
