"""Paged KV: the block pool, attention over block tables, and the decoder on them under
churn (join, leave, cancel), with exact accounting of the blocks in use."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from app.attention import (
    PagedCacheView,
    PagedDecodeStep,
    paged_attention,
)
from app.config import EngineConfig
from app.cpu_kernels import kernel_unavailable
from app.decode import Decoder
from app.decode_attention import inplace_attention_unavailable
from app.engine_core import EngineCore
from app.kv_cache import BlockAllocator, LayerSpan, PagedKVCache
from app.kv_package import KVLayout
from app.messages import FinishReason, PrefillRequest
from app.packed_linear import pack_linears
from app.sampling import SamplingParams
from app.sequence import Sequence
from tests.conftest import hf_greedy, make_tiny_model


def test_allocator_hands_out_the_lowest_free_blocks_and_takes_them_back():
    a = BlockAllocator(8, 4)
    assert a.blocks_for(1) == 1 and a.blocks_for(4) == 1 and a.blocks_for(5) == 2
    first = a.allocate(3)
    assert first == [0, 1, 2] and a.num_used == 3 and a.num_free == 5
    a.free([1])
    assert a.allocate(2) == [1, 3]  # the hole first
    with pytest.raises(MemoryError):
        a.allocate(a.num_free + 1)
    a.free([0, 1, 2, 3])
    assert a.num_used == 0


def _cache(num_blocks=16, block_size=4, layers=3, kv_heads=2, head_dim=8) -> PagedKVCache:
    layout = KVLayout(layers, kv_heads, head_dim, "float32")
    return PagedKVCache(layout, [LayerSpan(0, layers, torch.device("cpu"))], num_blocks,
                        block_size, torch.float32)


def test_cache_round_trips_a_package_through_scattered_blocks():
    cache = _cache()
    kv = torch.randn(3, 2, 2, 11, 8)  # [layers, 2, kv_heads, n, head_dim]
    table = [7, 2, 12]  # 11 tokens in blocks of 4: three blocks, not in order
    cache.write(table, kv)
    assert torch.equal(cache.read(table, 11), kv)
    assert cache.slots(table, 3, 6) == [7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]


def test_a_package_goes_in_one_copy_per_run_of_consecutive_blocks_and_nowhere_else():
    cache = _cache()
    table = [3, 4, 5, 9, 10, 1]  # runs 3-5, 9-10, 1; 22 tokens: the last block half full
    assert cache.runs(table, 22) == [(12, 0, 12), (36, 12, 8), (4, 20, 2)]
    assert cache.runs([0, 1, 2, 3], 16) == [(0, 0, 16)]
    for part in cache.parts:
        part.fill_(-7.0)
    kv = torch.randn(3, 2, 2, 22, 8).to(torch.bfloat16)  # cast to the pool's float32
    cache.write(table, kv)
    assert torch.equal(cache.read(table, 22), kv.float())
    slots = set(cache.slots(table, 0, 22))
    untouched = [i for i in range(cache.num_slots) if i not in slots]
    assert bool((cache.parts[0][:, :, untouched] == -7.0).all())
    with pytest.raises(IndexError):
        cache.write([15, 16], torch.randn(3, 2, 2, 5, 8))  # block 16 is outside the pool
    with pytest.raises(IndexError):
        cache.write([2], torch.randn(3, 2, 2, 5, 8))  # 5 positions need two blocks


_INPLACE = pytest.mark.skipif(
    inplace_attention_unavailable(torch.float32, ["cpu"], 8) is not None,
    reason=str(inplace_attention_unavailable(torch.float32, ["cpu"], 8)))


@pytest.mark.parametrize(("lengths", "layout"), [
    ([3, 17, 9], "padded"), ([3, 40, 2], "exact"),
    pytest.param([3, 17, 9], "inplace", marks=_INPLACE),
    pytest.param([1, 40, 2], "inplace", marks=_INPLACE)])
def test_paged_attention_equals_each_row_attending_alone(lengths, layout):
    """Rows of different lengths over scattered blocks, grouped-query heads, in both gather
    layouts (lengths alike: padded; one long row: exact) and read in place by the engine's
    CPU kernel: each row's output equals SDPA over exactly its own keys and values."""
    torch.manual_seed(0)
    cache = _cache(num_blocks=32, block_size=4, layers=1, kv_heads=2, head_dim=8)
    free = iter([5, 1, 9, 3, 20, 4, 30, 11, 7, 0, 2, 6, 8, 10, 12, 13, 14, 15, 16, 17])
    tables = [[next(free) for _ in range(-(-n // 4))] for n in lengths]
    per_row = [torch.randn(1, 2, 2, n, 8) for n in lengths]
    for table, kv in zip(tables, per_row, strict=True):
        cache.write(table, kv)
    positions = [n - 1 for n in lengths]  # each row re-writes its last position
    step = PagedDecodeStep.build(cache, tables, positions, inplace=layout == "inplace")
    assert step.exact is (layout == "exact") and step.inplace is (layout == "inplace")
    view = PagedCacheView(cache, step)
    new_k = torch.stack([kv[0, 0, :, -1] for kv in per_row])[:, :, None]  # [B, kvh, 1, hd]
    new_v = torch.stack([kv[0, 1, :, -1] for kv in per_row])[:, :, None]
    keys, values = view.update(new_k, new_v, 0)
    expected_rows = {"exact": sum(lengths), "padded": len(lengths) * max(lengths),
                     "inplace": 32 * 4}[layout]  # in place: the whole pool, no copy
    assert keys.shape == (expected_rows, 2, 8)
    if layout == "inplace":
        assert keys.data_ptr() == cache.layers[0][0].data_ptr()
    query = torch.randn(3, 4, 1, 8)  # 4 query heads over 2 KV heads
    out, _ = paged_attention(None, query, keys, values, None, scaling=0.3, paged_step=step)
    assert out.shape == (3, 1, 4, 8)
    for i, kv in enumerate(per_row):
        k = kv[0, 0].repeat_interleave(2, dim=0)[None]  # [1, heads, n, hd]
        v = kv[0, 1].repeat_interleave(2, dim=0)[None]
        alone = F.scaled_dot_product_attention(query[i : i + 1], k, v, scale=0.3)
        torch.testing.assert_close(out[i, 0], alone[0, :, 0], rtol=1e-5, atol=1e-6)


def _core(model, **cfg) -> EngineCore:
    return EngineCore(EngineConfig(**cfg), model=model)


def _sequence(pkg) -> Sequence:
    s = Sequence(pkg.request_id, list(pkg.prompt_token_ids), pkg.sampling)
    s.append(pkg.first_token, eos_token_ids=frozenset(), max_model_len=512)
    return s


def _check_accounting(dec: Decoder) -> None:
    st = dec.stats()
    bs = dec.blocks.block_size
    assert st.kv_tokens_used <= st.kv_tokens_reserved <= st.kv_tokens_budget
    # blocks in use are exactly what the running sequences hold: less than a block of slack
    # per sequence (plus the block a sequence takes for the token it writes next)
    assert st.kv_tokens_live <= st.kv_tokens_used < st.kv_tokens_live + 2 * bs * max(
        1, st.running)
    held = [b for s in dec.running for b in s.blocks]
    assert len(held) == len(set(held)) == dec.blocks.num_used  # no block shared or leaked


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.skipif(
    kernel_unavailable() is not None, reason=f"{kernel_unavailable()}"))])
def test_churn_keeps_every_sequence_exact_and_returns_every_block(tiny_model, fused):
    """Sequences join at different steps, leave at different lengths, some are cancelled:
    each one's tokens equal decoding it alone; the pool is empty when idle. ``fused``: the
    same weights panel-packed, so steps run as one call to the fused kernel
    (app.fused_decode)."""
    rng = random.Random(3)
    model = tiny_model
    if fused:
        model = make_tiny_model()  # the fixture's weights, packed
        pack_linears(model, layout="panels")
    core = _core(model)
    assert (core.runner.fused is not None) is fused
    dec = Decoder(core.runner, eos_token_ids=frozenset(), max_batch_size=5,
                  max_kv_tokens=1024, block_size=8)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))]
               for _ in range(12)]
    max_tokens = [rng.randrange(2, 24) for _ in prompts]
    max_tokens[3] = max_tokens[8] = 30  # still running (3) or waiting (8) when cancelled
    pkgs = core.make_prefiller().make_packages(
        [PrefillRequest(f"c{i}", tuple(p), SamplingParams(max_tokens=m, temperature=0.0))
         for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))])
    seqs = [_sequence(pkg) for pkg in pkgs]
    cancelled = {3, 8}
    pending = list(zip(seqs, pkgs, strict=True))
    step = 0
    while pending or dec.has_work:
        if pending and step % 2 == 0:  # a new sequence every other step
            dec.add(*pending.pop(0))
        if step == 10:
            assert dec.cancel(seqs[3].request_id) is seqs[3]  # joined at step 6: running
        if step == 16:
            assert dec.cancel(seqs[8].request_id) is seqs[8]  # added just now: waiting
        dec.step()
        _check_accounting(dec)
        step += 1
    for i, (p, m, s) in enumerate(zip(prompts, max_tokens, seqs, strict=True)):
        alone = hf_greedy(tiny_model, p, m)
        if i in cancelled:
            assert s.finish_reason is FinishReason.CANCELLED
            assert s.output_token_ids == alone[: len(s.output_token_ids)]
        else:
            assert s.output_token_ids == alone, i
    assert dec.blocks.num_used == 0 and dec.reserved_blocks == 0
    assert all(s.blocks == [] for s in seqs)


def test_a_tight_pool_makes_sequences_wait_and_one_too_big_is_refused(tiny_model):
    core = _core(tiny_model)
    # 64 tokens of KV: each sequence below reserves 20 + 20 = 40 tokens (5 blocks of 8)
    dec = Decoder(core.runner, eos_token_ids=frozenset(), max_batch_size=8,
                  max_kv_tokens=64, block_size=8)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 49152) for _ in range(20)] for _ in range(3)]
    pkgs = core.make_prefiller().make_packages(
        [PrefillRequest(f"t{i}", tuple(p), SamplingParams(max_tokens=20, temperature=0.0))
         for i, p in enumerate(prompts)])
    [big] = core.make_prefiller().make_packages(
        [PrefillRequest("big", tuple(range(10, 70)), SamplingParams(max_tokens=20,
                                                                    temperature=0.0))])
    seqs = [_sequence(p) for p in pkgs]
    for s, pkg in zip(seqs, pkgs, strict=True):
        dec.add(s, pkg)
    most_running = 0
    while dec.has_work:
        dec.step()
        _check_accounting(dec)
        most_running = max(most_running, len(dec.running))
    assert most_running == 1  # two reservations of 5 blocks never fit in 8
    for p, s in zip(prompts, seqs, strict=True):
        assert s.output_token_ids == hf_greedy(tiny_model, p, 20)
    too_big = _sequence(big)
    dec.add(too_big, big)
    dec.step()
    assert too_big.finish_reason is FinishReason.ERROR and not dec.has_work
