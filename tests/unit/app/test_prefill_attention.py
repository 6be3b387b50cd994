"""Prefill attention in the engine's kernel (app/csrc/prefill_attention.c, its AVX2 path and,
where the CPU has it, its AVX-512 one): the attention torch's SDPA gives under the same masks
(causal, after a cached or earlier-chunk past, rows of a padded batch), through the model
runner's prefill and mixed passes, and a clear reason where it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app import cpu_kernels
from app.config import EngineConfig
from app.model_runner import ModelRunner
from app.prefill_attention import _kernel_prefill_attention, prefill_attention_unavailable
from tests.conftest import make_tiny_model

_REASON = cpu_kernels.cpu_unsupported() or cpu_kernels.kernel_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))


def _paths() -> list[int]:
    """The kernel's paths this CPU runs (``panel_set_avx512``): 0 = AVX2, 1 = AVX-512."""
    return [0, 1] if _REASON is None and cpu_kernels.load_kernel().panel_has_avx512() else [0]


def _on_each_path(compute):
    """``compute()`` once per path this CPU runs, the AVX-512 one (where there is one) left in
    force afterwards, as the kernel decides by itself."""
    lib = cpu_kernels.load_kernel()
    try:
        outs = []
        for wide in _paths():
            assert lib.panel_set_avx512(wide) == wide
            outs.append(compute())
        return outs
    finally:
        lib.panel_set_avx512(1)


def _reference(q, k, v, starts, pmax, scale):
    """SDPA with the kernel's mask spelled out: row b's query i sees keys j < starts[b] and
    pmax <= j <= pmax + i; KV heads repeated for the query heads that share them."""
    _, heads, seq, _ = q.shape
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    j = torch.arange(k.shape[2])[None, :]
    i = torch.arange(seq)[:, None]
    mask = torch.stack([(j < s) | ((j >= pmax) & (j <= pmax + i)) for s in starts])[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(64, 9, 3), (16, 4, 2), (128, 2, 1)])
@pytest.mark.parametrize(("seq", "starts"), [(1, [0]), (13, [0]), (100, [0]), (29, [37]),
                                             (12, [20, 0, 37]), (40, [16, 16])])
@torch.inference_mode()
def test_the_kernel_gives_sdpa_under_the_same_mask(threads, head_dim, heads, kv_heads, seq,
                                                   starts):
    torch.manual_seed(seq + head_dim)
    bsz, pmax = len(starts), max(starts)
    # the query as the model's layers hand it over: [B, S, H, D] memory seen as [B, H, S, D]
    q = torch.randn(bsz, seq, heads, head_dim).transpose(1, 2)
    k = torch.randn(bsz, kv_heads, pmax + seq, head_dim)
    v = torch.randn(bsz, kv_heads, pmax + seq, head_dim)
    scale = head_dim ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outs = _on_each_path(
            lambda: _kernel_prefill_attention(q, k, v, torch.tensor(starts), pmax, None))
    finally:
        torch.set_num_threads(before)
    reference = _reference(q, k, v, starts, pmax, scale)
    for out in outs:
        assert out.shape == (bsz, seq, heads, head_dim)
        torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)


@torch.inference_mode()
def test_the_padded_past_between_a_rows_own_and_the_new_tokens_is_never_read():
    """Row 0 holds 5 past positions of a 37-wide padded past: whatever fills the other 32
    (here NaN) must not reach its output."""
    torch.manual_seed(1)
    q = torch.randn(2, 4, 9, 16)
    k, v = torch.randn(2, 2, 46, 16), torch.randn(2, 2, 46, 16)
    run = lambda: _kernel_prefill_attention(q, k, v, torch.tensor([5, 37]), 37, None)  # noqa: E731
    clean = _on_each_path(run)
    k[0, :, 5:37] = float("nan")
    v[0, :, 5:37] = float("nan")
    dirty = _on_each_path(run)
    for a, b in zip(clean, dirty, strict=True):
        assert torch.equal(a, b)


def _runner(kernel: bool) -> ModelRunner:
    return ModelRunner(make_tiny_model(seed=8), EngineConfig(kernels={"attention": kernel}))


@torch.inference_mode()
def test_prefill_passes_through_the_kernel_give_the_sdpa_passes_logits_and_kv():
    fast, plain = _runner(True), _runner(False)
    assert fast.prefill_kernel and not plain.prefill_kernel
    assert plain.prefill_attention_reason == "turned off (kernels.attention: false)"
    prompts = [list(range(3, 80)), [5, 9, 33], list(range(200, 240))]
    for runner_prompts in (prompts, prompts[:1]):
        (la, kva), (lb, kvb) = fast.forward_prefill(runner_prompts), plain.forward_prefill(
            runner_prompts)
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
        assert torch.equal(la.argmax(-1), lb.argmax(-1))
        for a, b in zip(kva, kvb, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # a prompt's second chunk after its first (rows of different pasts), as chunked prefill
    # and a prefix-cache hit run it
    first = [p[:n] for p, n in zip(prompts, (50, 1, 17), strict=True)]
    rest = [p[n:] for p, n in zip(prompts, (50, 1, 17), strict=True)]
    outs = []
    for runner in (fast, plain):
        _, past = runner.forward_prefill(first)
        outs.append(runner.forward_prefill(rest, past))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-4, atol=1e-4)
    for a, b in zip(outs[0][1], outs[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_a_mixed_pass_attends_its_chunks_through_the_kernel_as_through_sdpa():
    results = []
    for kernel in (True, False):
        runner = _runner(kernel)
        cache = runner.make_kv_cache(64, 4)
        tables = [list(range(0, 8)), list(range(8, 16))]
        decode_prompts = [[4, 8, 15, 16, 23], list(range(60, 81))]
        logits, kvs = runner.forward_prefill(decode_prompts)
        for table, kv in zip(tables, kvs, strict=True):
            cache.write(table, kv)
        _, past = runner.forward_prefill([list(range(300, 333))])
        out = runner.forward_mixed(cache, tables, logits.argmax(-1).tolist(),
                                   [len(p) for p in decode_prompts],
                                   [list(range(333, 360)), list(range(9, 40))], [past[0], None])
        results.append(out)
    (da, ca, ka), (db, cb, kb) = results
    torch.testing.assert_close(da, db, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ca, cb, rtol=1e-4, atol=1e-4)
    for a, b in zip(ka, kb, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_where_the_kernel_does_not_apply_it_says_why():
    assert prefill_attention_unavailable(torch.bfloat16, ["cpu"], 64) == "the model is not float32"
    assert prefill_attention_unavailable(torch.float32, ["cpu"], 24) == (
        "head_dim 24 is not a multiple of 16 up to 256")
    assert prefill_attention_unavailable(torch.float32, ["cuda:0"], 64) == (
        "the model is not on the CPU")
    assert prefill_attention_unavailable(torch.float32, ["cpu"], 64) is None


def test_cudnn_attention_is_turned_off_only_for_a_cuda_runner():
    """cuDNN plans each new shape (decode's key length changes every step): a runner on a
    CUDA device turns it off for its process; a CPU runner leaves torch's settings alone."""
    from app.attention import serving_sdpa_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert serving_sdpa_backends([torch.device("cpu")]) is None
        assert torch.backends.cuda.cudnn_sdp_enabled()
        note = serving_sdpa_backends([torch.device("cpu"), torch.device("cuda", 1)])
        assert note and "cuDNN attention off" in note
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
