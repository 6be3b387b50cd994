"""Prefill attention through the engine's CPU kernels: a prefill pass's rows (and a mixed
pass's prompt chunks) attending causally to themselves after their earlier positions
(``app/csrc/prefill_attention.c``, float32 products, AVX-512 or AVX2), or, for an engine that
serves bf16 on a CPU with AVX512-BF16, the same pass with bf16 products and float32 sums
(``app/csrc/prefill_attention_bf16.c``: q, k, v and the probabilities rounded to bf16 as they
enter the products, as vLLM's CPU attention computes a bf16 model; twice the float32
kernel's rate, BENCHMARKS.md §1, "Prefill passes"). :class:`PrefillSpan` is what a pass's
layers share; ``app.attention.paged_attention`` calls :func:`_kernel_prefill_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.cpu_kernels import assert_kernel_tensors, check, kernel_unavailable, load_kernel


@dataclass(slots=True)
class PrefillSpan:
    """What a prefill pass's layers share when its attention runs in the engine's kernel
    (``app/csrc/prefill_attention.c``): the keys are a padded past of ``pmax`` positions
    (row ``i``'s first ``starts[i]`` real) followed by the pass's own, causally."""

    starts: torch.Tensor  # [B] int64
    pmax: int
    bf16: bool = False  # bf16 products (prefill_attention_bf16.c)

    @classmethod
    def build(cls, starts: list[int], bf16: bool = False) -> PrefillSpan:
        return cls(torch.tensor(starts, dtype=torch.long), max(starts, default=0), bf16)


def prefill_attention_unavailable(dtype: torch.dtype, devices, head_dim: int,
                                  cache_dir=None) -> str | None:
    """Why prefill passes (and the chunks of mixed passes) cannot attend through the engine's
    kernel (``app/csrc/prefill_attention.c``: AVX-512 where the CPU has it, else AVX2), or
    None when they can."""
    if any(torch.device(d).type != "cpu" for d in devices):
        return "the model is not on the CPU"
    if dtype != torch.float32:
        return "the model is not float32"
    if head_dim % 16 or head_dim > 256:
        return f"head_dim {head_dim} is not a multiple of 16 up to 256"
    return kernel_unavailable(cache_dir)


def _kernel_serves(query, key, kwargs) -> bool:
    """A pass the prefill kernel computes as the model's SDPA would: float32 on the CPU, no
    attention window shorter than the keys, no logit soft-capping."""
    window = kwargs.get("sliding_window")
    return (query.dtype == torch.float32 and key.dtype == torch.float32
            and query.device.type == "cpu" and key.device.type == "cpu"
            and (window is None or window >= key.shape[2])
            and kwargs.get("softcap") is None)


def bf16_attention_unavailable(weights: str | None) -> str | None:
    """Why prefill attention keeps float32 products, or None where it takes bf16 ones: an
    engine serving bf16 weights through the CPU's bf16 dot product (``weights`` is the
    panels' kind, ``bfloat16dp``) takes them in attention too."""
    if weights != "bfloat16dp":
        return f"the weights are {weights or 'not panel-packed'}, not bf16 dot-product panels"
    return None


def _kernel_prefill_attention(query, key, value, starts: torch.Tensor, pmax: int, scaling,
                              bf16: bool = False, out: torch.Tensor | None = None):
    """``query`` [B, heads, S, hd] over ``key``/``value`` [B, kv_heads, pmax + S, hd] (row
    ``i`` sees its first ``starts[i]`` positions and, causally, the last S) -> the attention
    output [B, S, heads, hd], the layout ``sdpa_attention_forward`` returns. ``bf16``: the
    products in bf16 (``prefill_attention_bf16``), sums in float32. ``out``: where to
    write it (float32, strided, each head's row contiguous), else made."""
    bsz, heads, seq, head_dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    assert_kernel_tensors(starts=(starts, torch.long))  # q, k, v: strided, rows contiguous
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, v))
    assert k.shape == v.shape == (bsz, kv_heads, total, head_dim) and total == pmax + seq
    assert starts.numel() == bsz, "starts: one a row"
    if out is None:
        out = torch.empty((bsz, seq, heads, head_dim), dtype=torch.float32)
    assert out.shape == (bsz, seq, heads, head_dim) and out.dtype == torch.float32
    assert out.device.type == "cpu" and out.stride(-1) == 1, "out: rows of head_dim in a row"
    lib = load_kernel()
    entry = "prefill_attention_bf16" if bf16 else "prefill_attention"
    rc = getattr(lib, entry)(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
        k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        v.data_ptr(), v.stride(0), v.stride(1), v.stride(2),
        out.data_ptr(), out.stride(0), out.stride(2), out.stride(1),
        bsz, heads, kv_heads, seq, total, head_dim, starts.data_ptr(), pmax,
        head_dim ** -0.5 if scaling is None else float(scaling), torch.get_num_threads())
    check(rc, entry)
    return out
