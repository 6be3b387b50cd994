"""KV package: exact round trips, out-of-band serialization size, compatibility checks."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from app.errors import KVPackageMismatchError
from app.kv_package import KVLayout, KVPackage, serialized_sizes
from app.sampling import SamplingParams

FP = "LlamaForCausalLM/L2/kvh3/hd8/v49152/float32/abc"


def _package(kv: torch.Tensor, *, vocab_size: int = 49152, fp: str = FP) -> KVPackage:
    n = kv.shape[3]
    return KVPackage.from_tensor(
        request_id="req-1",
        fingerprint=fp,
        kv=kv,
        prompt_token_ids=[(7 * i + 1) % vocab_size for i in range(n)],
        first_token=42,
        sampling=SamplingParams(max_tokens=5, temperature=0.7, seed=9, stop=("x",)),
        vocab_size=vocab_size,
        created_at=123.0,
        prefill_s=0.5,
    )


@pytest.mark.parametrize(("dtype", "wire"), [(torch.float32, np.float32),
                                              (torch.bfloat16, np.uint16)])
def test_round_trip_is_exact(dtype, wire):
    kv = torch.randn(2, 2, 3, 11, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    pkg = _package(kv)
    assert pkg.kv.dtype == wire
    assert pkg.layout == KVLayout(2, 3, 8, "float32" if dtype is torch.float32 else "bfloat16")
    assert pkg.seq_len == 11 and pkg.prompt_ids == [(7 * i + 1) for i in range(11)]
    assert pkg.kv_nbytes == kv.numel() * kv.element_size()
    back = pkg.kv_tensor()
    assert back.dtype is dtype and back.shape == kv.shape
    assert torch.equal(back, kv)

    # through pickle protocol 5 with out-of-band buffers, as Ray ships it
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(pkg, protocol=5, buffer_callback=buffers.append)
    copy = pickle.loads(data, buffers=buffers)
    assert torch.equal(copy.kv_tensor(), kv)
    assert copy.prompt_ids == pkg.prompt_ids and copy.first_token == 42
    assert copy.sampling == pkg.sampling and copy.layout == pkg.layout
    copy.check_compatible(FP, pkg.layout)


def test_prompt_ids_dtype_follows_vocab_size():
    kv = torch.zeros(1, 2, 1, 3, 4)
    assert _package(kv, vocab_size=1 << 16).prompt_token_ids.dtype == np.uint16
    big = _package(kv, vocab_size=150_000)
    assert big.prompt_token_ids.dtype == np.int32


@pytest.mark.parametrize(("dtype", "nbytes"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_serialized_sizes_smollm2_shape(dtype, nbytes):
    layers, kv_heads, head_dim, tokens = 30, 3, 64, 1024
    kv = torch.zeros(layers, 2, kv_heads, tokens, head_dim, dtype=dtype)
    pkg = _package(kv)
    inband, oob = serialized_sizes(pkg)
    theory = 2 * layers * kv_heads * head_dim * nbytes * tokens
    assert pkg.layout.bytes_per_token() * tokens == theory
    assert abs(oob - theory) <= 0.05 * theory
    assert inband < 4096


def test_check_compatible_rejects_mismatches():
    kv = torch.randn(2, 2, 3, 5, 8)
    pkg = _package(kv)
    layout = KVLayout(2, 3, 8, "float32")
    pkg.check_compatible(FP, layout)  # the matching engine accepts it

    with pytest.raises(KVPackageMismatchError, match="made by model") as info:
        pkg.check_compatible(FP.replace("abc", "abd"), layout)
    assert info.value.code == "kv_package_mismatch"
    with pytest.raises(KVPackageMismatchError, match="layout"):
        pkg.check_compatible(FP, KVLayout(2, 3, 8, "bfloat16"))  # other KV dtype
    with pytest.raises(KVPackageMismatchError, match="layout"):
        pkg.check_compatible(FP, KVLayout(3, 3, 8, "float32"))  # other layer count

    # the array does not match the layout it claims
    wrong_shape = dataclasses.replace(pkg, kv=pkg.kv[:, :, :, :, :4].copy())
    with pytest.raises(KVPackageMismatchError, match="holds"):
        wrong_shape.check_compatible(FP, layout)
    wrong_dtype = dataclasses.replace(pkg, kv=pkg.kv.astype(np.float16))
    with pytest.raises(KVPackageMismatchError, match="holds"):
        wrong_dtype.check_compatible(FP, layout)
    short_prompt = dataclasses.replace(pkg, prompt_token_ids=pkg.prompt_token_ids[:-1])
    with pytest.raises(KVPackageMismatchError, match="inconsistent lengths"):
        short_prompt.check_compatible(FP, layout)


# ---- leaving and reaching the device ------------------------------------------------------


def test_cpu_kv_goes_to_the_package_without_a_copy_or_pinning(monkeypatch):
    """On the CPU the pinned staging path is skipped: the package's array is the tensor's own
    memory (the object store then copies it once, as it must)."""
    import app.kv_package as kvp

    def no_staging(*args, **kwargs):
        raise AssertionError("a CPU tensor must not be staged")

    monkeypatch.setattr(kvp, "stage_to_host", no_staging)
    kv = torch.randn(2, 2, 3, 6, 8)
    pkg = _package(kv)
    assert pkg.kv.ctypes.data == kv.data_ptr()
    back = pkg.kv_tensor("cpu")
    assert back.data_ptr() == kv.data_ptr()  # and back, zero-copy
    assert torch.equal(back, kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staging_copies_into_a_fresh_host_buffer(dtype):
    """The staging step of the GPU path (here from a CPU tensor, pinned where CUDA exists):
    a new contiguous buffer of the same values, dtype and shape, pinned iff asked."""
    from app.kv_package import stage_to_host

    pin = torch.cuda.is_available()
    src = torch.randn(2, 2, 3, 9, 8).to(dtype)
    view = src[:, :, :, 2:7]  # non-contiguous, as a slice of a batch buffer would be
    host = stage_to_host(view, pin=pin)
    assert host.is_contiguous() and host.dtype is dtype and host.shape == view.shape
    assert host.device.type == "cpu" and host.is_pinned() == pin
    assert host.data_ptr() != src.data_ptr()
    assert torch.equal(host, view)
    src.zero_()  # the staged copy does not alias the device tensor
    assert not torch.equal(host, view)


def test_kv_tensor_loads_onto_the_requested_device():
    kv = torch.randn(2, 2, 3, 4, 8).to(torch.bfloat16)
    pkg = _package(kv)
    target = torch.device("cpu")
    back = pkg.kv_tensor(target)
    assert back.device == target and back.dtype is torch.bfloat16
    assert torch.equal(back, kv)
