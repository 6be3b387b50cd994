"""Writing a pass's keys and values (``app.kv_cache.store_rows``, the kernel's
``kv_store_rows``) and reusing chunked prompts' KV buffers (``SpareBuffers``): the kernel
writes what torch's indexed copies write, bit for bit, into a pool (by slot, float32 or
bf16) and into a prompt's KV from a position on; a reused buffer never holds a package
that is still in use."""

from __future__ import annotations

import pytest
import torch

from app.cpu_kernels import KernelError, kernel_unavailable
from app.kv_cache import SpareBuffers, store_rows

needs_kernel = pytest.mark.skipif(kernel_unavailable() is not None,
                                  reason="the kernels need x86-64 with AVX2/FMA and a compiler")


def _pass_rows(rows: int, kv_heads: int = 3, hd: int = 64):
    """Keys and values ``[kv_heads, rows, hd]`` as a fused layer hands them over: strided
    views of one q/k/v product's rows (q first), with a NaN (row 0's first key) and a value
    halfway between two bf16 ones (row 1's second)."""
    nq, nkv = 2 * kv_heads * hd, kv_heads * hd
    qkv = torch.randn(rows, nq + 2 * nkv) * 3
    qkv[0, nq] = float("nan")
    qkv[1, nq + 1] = 1.0 + 2.0 ** -8  # halfway between two bf16 values: to even
    kv = qkv[:, nq:]
    k = kv[:, :nkv].view(rows, kv_heads, hd).transpose(0, 1)
    v = kv[:, nkv:].view(rows, kv_heads, hd).transpose(0, 1)
    return k, v


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_into_pool_slots_equal_torchs_indexed_copy(dtype):
    k, v = _pass_rows(5)
    slots = torch.tensor([7, 0, 63, 12, 40])
    pool = torch.zeros(2, 64, 3, 64, dtype=dtype)
    want = pool.clone()
    want[0, slots] = k.transpose(0, 1).to(dtype)
    want[1, slots] = v.transpose(0, 1).to(dtype)
    assert store_rows(k, v, pool[0], pool[1], slots)
    # exact, the halfway value rounded to even; a NaN stays NaN (torch's own encodings of it
    # differ between its scalar and vector conversions)
    torch.testing.assert_close(pool.float(), want.float(), rtol=0, atol=0, equal_nan=True)
    assert pool[0, 7, 0, 0].isnan()
    assert pool[0, 0, 0, 1] == (1.0 if dtype == torch.bfloat16 else 1.0 + 2.0 ** -8)


@needs_kernel
def test_a_chunk_into_a_prompts_kv_from_its_position():
    k, v = _pass_rows(9)
    whole = torch.zeros(4, 2, 3, 32, 64)  # [layers, 2, kv_heads, N, hd]
    dst, p = whole[2], 11
    assert store_rows(k[:, 4:], v[:, 4:], dst[0, :, p:].transpose(0, 1),
                      dst[1, :, p:].transpose(0, 1))
    want = torch.zeros_like(whole)
    want[2, 0, :, p : p + 5] = k[:, 4:]
    want[2, 1, :, p : p + 5] = v[:, 4:]
    assert torch.equal(whole.view(torch.int32), want.view(torch.int32))


@needs_kernel
def test_refusals_write_nothing():
    k, v = _pass_rows(3)
    pool = torch.zeros(2, 8, 3, 64)
    with pytest.raises(KernelError, match="write"):
        store_rows(k, v, pool[0], pool[1], torch.tensor([1, 2, 8]))
    with pytest.raises(KernelError, match="write"):  # 3 positions from 6 of 8
        store_rows(k, v, pool[0, 6:], pool[1, 6:])
    assert not pool.any()
    # tensors the kernel does not take: nothing written, the caller copies with torch
    assert not store_rows(k, v, pool[0].half(), pool[1].half(), torch.tensor([0, 1, 2]))
    assert not store_rows(k.double(), v.double(), pool[0], pool[1], torch.tensor([0, 1, 2]))
    assert not pool.any()


def test_spare_buffers_are_reused_smallest_first_and_bounded():
    spares = SpareBuffers(count=2, max_bytes=4096 * 4)
    a = spares.take((2, 3, 100), torch.float32, "cpu")
    b = spares.take((10, 100), torch.float32, "cpu")
    assert a.shape == (2, 3, 100) and a.is_contiguous()
    pa, pb = a.data_ptr(), b.data_ptr()
    spares.give(a)
    spares.give(b)
    spares.give(b)  # once only
    assert spares.take((5, 100), torch.float32, "cpu").data_ptr() == pa  # 600 floats hold 500
    assert spares.take((5, 100), torch.float32, "cpu").data_ptr() == pb
    assert spares.take((5, 100), torch.float32, "cpu").data_ptr() not in (pa, pb)
    spares.give(spares.take((1000,), torch.bfloat16, "cpu"))
    assert spares.take((1000,), torch.float32, "cpu").dtype == torch.float32  # not the bf16
    spares.give(torch.empty(5000))  # over max_bytes: left to the allocator
    spares.give(torch.empty(3, 3))  # not one of take's: ignored
    assert [b.numel() for b in spares._free] == [1000]


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16"])
def test_chunked_prompts_reuse_kv_buffers_without_touching_a_delivered_package(tiny_model,
                                                                              kv_dtype):
    """Chunked prompts one after another, each written chunk by chunk into its float32 KV
    so far: with bf16 KV that buffer is dead once the package is cast, and the next prompt
    reuses it; with float32 KV it is the package, and is never reused. Either way a package
    delivered earlier keeps its KV, and each equals the prompt's KV made alone."""
    from app.config import EngineConfig
    from app.engine_core import EngineCore
    from app.messages import PrefillRequest
    from app.sampling import SamplingParams

    def prefiller(**cfg):
        return EngineCore(EngineConfig(prefix_cache_mb=0, kv_dtype=kv_dtype, **cfg),
                          model=tiny_model).make_prefiller()

    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    reqs = [PrefillRequest(f"r{i}", tuple(range(3 + i, 43 + i)), greedy) for i in range(3)]
    chunked = prefiller(prefill_chunk_tokens=8)
    taken, take = [], chunked.spares.take
    chunked.spares.take = lambda *a: taken.append(take(*a)) or taken[-1]
    packages, kvs = [], []
    for req in reqs:
        packages.append(chunked.make_packages([req])[0])
        kvs.append(packages[-1].kv_tensor().clone())  # as delivered
    assert len(taken) == 3
    reused = len({t.data_ptr() for t in taken}) == 1
    assert reused == (kv_dtype == "bfloat16")
    for req, got, kv in zip(reqs, packages, kvs, strict=True):
        assert torch.equal(got.kv_tensor(), kv)  # not overwritten by a later prompt
        [want] = prefiller(prefill_chunk_tokens=8).make_packages([req])
        assert torch.equal(got.kv_tensor(), want.kv_tensor())
