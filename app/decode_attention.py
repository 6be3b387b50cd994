"""Decode rows' attention over the paged KV pool: read in place by the engine's kernel
(``app/csrc/paged_attention.c``: each row's own slots, float32 or bf16, no gathered copy),
or over the gathered keys and values through torch's SDPA (any device and dtype). Used by
decode steps that run the model's modules and by a mixed pass's decode rows
(``app.attention``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from app.cpu_kernels import assert_kernel_tensors, check, kernel_unavailable, load_kernel

if TYPE_CHECKING:
    from app.attention import PagedDecodeStep


def inplace_attention_unavailable(cache_dtype: torch.dtype, devices, head_dim: int,
                                  cache_dir=None,
                                  compute_dtype: torch.dtype = torch.float32) -> str | None:
    """Why decode attention cannot read the pool in place (the engine's CPU kernel,
    ``app/csrc/paged_attention.c``: float32 queries and sums over a float32 or bf16 pool),
    or None when it can."""
    if any(torch.device(d).type != "cpu" for d in devices):
        return "the KV pool is not on the CPU"
    if compute_dtype != torch.float32:
        return f"the model computes in {compute_dtype}, the kernel in float32"
    if cache_dtype not in (torch.float32, torch.bfloat16):
        return "the KV pool is neither float32 nor bfloat16"
    if head_dim % 8:
        return f"head_dim {head_dim} is not a multiple of 8"
    return kernel_unavailable(cache_dir)


def inplace_decode_attention(query, keys, values, step: PagedDecodeStep, scaling, out=None):
    """``out``: [B, heads, hd] float32, contiguous, written (else made)."""
    bsz, heads, _, head_dim = query.shape
    kv_heads = keys.shape[1]
    read, offsets = step.read_slots[keys.device], step.offsets
    assert keys.dtype in (torch.float32, torch.bfloat16), keys.dtype
    assert_kernel_tensors(keys=(keys, keys.dtype), values=(values, keys.dtype),
                          read=(read, torch.long), offsets=(offsets, torch.long))
    assert keys.shape == values.shape and keys.shape[2] == head_dim
    assert offsets.numel() == bsz + 1, "offsets: one more than the rows"
    q = query.reshape(bsz, heads, head_dim).to(torch.float32).contiguous()
    out = torch.empty((bsz, heads, head_dim), dtype=torch.float32) if out is None else out
    assert_kernel_tensors(out=(out, torch.float32))
    assert out.shape == (bsz, heads, head_dim), "out: [rows, heads, head_dim]"
    rc = load_kernel().paged_decode_attention(
        q.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[0], kv_heads, head_dim,
        heads // kv_heads, read.data_ptr(), read.numel(), offsets.data_ptr(), bsz,
        head_dim ** -0.5 if scaling is None else float(scaling), out.data_ptr(),
        torch.get_num_threads(), keys.dtype == torch.bfloat16)
    check(rc, "paged_decode_attention")
    return out.view(bsz, 1, heads, head_dim).to(query.dtype)


def decode_attention(query, key, value, step: PagedDecodeStep, scaling):
    """Decode rows over their gathered keys/values (or, ``step.inplace``, the whole pool
    read in place): ``query`` [B, heads, 1, hd] -> the attention output [B, 1, heads, hd]."""
    bsz, heads, q_len, head_dim = query.shape
    assert q_len == 1 and bsz == step.rows, "paged attention is for decode steps"
    if step.inplace:
        return inplace_decode_attention(query, key, value, step, scaling)
    kv_heads = key.shape[1]
    group = heads // kv_heads
    mask = step.mask[query.device]
    if step.exact:
        # key, value: [T, kv_heads, hd]; every row's queries over all T positions, a row's
        # mask row keeping only its own
        q = query.reshape(bsz, kv_heads, group, head_dim).transpose(0, 1)
        q = q.reshape(1, kv_heads, bsz * group, head_dim)
        out = F.scaled_dot_product_attention(
            q, key.transpose(0, 1)[None], value.transpose(0, 1)[None],
            attn_mask=mask.repeat_interleave(group, 0), scale=scaling)  # [1, kvh, B*g, hd]
        out = out.reshape(kv_heads, bsz, group, head_dim).transpose(0, 1)
        return out.reshape(bsz, 1, heads, head_dim)  # [B, 1, heads, hd]
    # key, value: [B * longest, kv_heads, hd]
    k = key.view(bsz, -1, kv_heads, head_dim).transpose(1, 2)  # [B, kv_heads, longest, hd]
    v = value.view(bsz, -1, kv_heads, head_dim).transpose(1, 2)
    q = query.reshape(bsz, kv_heads, group, head_dim)  # [B, kv_heads, group, hd]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.reshape(bsz, 1, heads, head_dim)  # [B, 1, heads, hd]
