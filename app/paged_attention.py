"""Decode attention over block tables: every row attends exactly its own positions.

A decode step gathers each running sequence's keys and values from its own blocks into a
``[rows, longest, kv_heads, head_dim]`` block, and attends every row in one SDPA call per
layer. A row shorter than the longest is filled with its own first position, masked out: every
read is of the row's own blocks (never of another sequence's, never of uninitialized memory),
and the compute is that of a batch padded to the step's longest row.

Grouped-query attention needs no repeated KV: the query heads that share a KV head become
that head's query positions (``[rows, kv_heads, group, head_dim]``).

Registered with transformers as the attention implementation ``splitserve_paged``: any pass
without a :class:`PagedDecodeStep` (prefill, ``generate()``) runs the model's SDPA unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from app.kv_cache import PagedKVCache

PAGED_ATTENTION = "splitserve_paged"


@dataclass(slots=True)
class PagedDecodeStep:
    """What every layer of one decode step shares, per device that holds KV."""

    rows: int
    write_slots: dict[torch.device, torch.Tensor]  # [B]: where each row's new token goes
    read_slots: dict[torch.device, torch.Tensor]  # [B * longest]: each row's positions
    mask: dict[torch.device, torch.Tensor | None]  # [B, 1, 1, longest] bool; None: all full

    @classmethod
    def build(cls, cache: PagedKVCache, tables: list[list[int]],
              positions: list[int]) -> PagedDecodeStep:
        """Row ``i`` writes its new token at ``positions[i]`` and reads ``0..positions[i]``."""
        rows = len(tables)
        longest = max(positions) + 1
        offsets = torch.arange(cache.block_size)
        read = torch.empty((rows, longest), dtype=torch.long)
        for i, (table, pos) in enumerate(zip(tables, positions, strict=True)):
            slots = (torch.tensor(table)[:, None] * cache.block_size + offsets).view(-1)
            read[i, : pos + 1] = slots[: pos + 1]
            read[i, pos + 1 :] = slots[0]  # the row's own first position, masked out
        write = read[torch.arange(rows), torch.tensor(positions)]
        mask = None
        if min(positions) + 1 < longest:
            lengths = torch.tensor([p + 1 for p in positions])
            mask = (torch.arange(longest)[None, :] < lengths[:, None])[:, None, None, :]
        return cls(
            rows=rows,
            write_slots={d: write.to(d) for d in cache.devices},
            read_slots={d: read.view(-1).to(d) for d in cache.devices},
            mask={d: None if mask is None else mask.to(d) for d in cache.devices},
        )


class PagedCacheView:
    """The cache a decode step hands the model's layers: ``update`` writes each row's new
    key and value into its slot and returns every row's keys and values, gathered."""

    def __init__(self, cache: PagedKVCache, step: PagedDecodeStep) -> None:
        self.layers = cache.layers
        self.step = step

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states, value_states: [B, kv_heads, 1, head_dim]
        layer = self.layers[layer_idx]  # [2, slots, kv_heads, head_dim]
        write = self.step.write_slots[layer.device]
        layer[0, write] = key_states[:, :, 0].to(layer.dtype)
        layer[1, write] = value_states[:, :, 0].to(layer.dtype)
        read = self.step.read_slots[layer.device]
        # [B * longest, kv_heads, head_dim] each
        return layer[0].index_select(0, read), layer[1].index_select(0, read)


def paged_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                    paged_step: PagedDecodeStep | None = None, **kwargs):
    """The model's SDPA attention, except in a decode step given a :class:`PagedDecodeStep`."""
    if paged_step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    # query: [B, heads, 1, hd]; key, value: [B * longest, kv_heads, hd] from the cache view
    bsz, heads, q_len, head_dim = query.shape
    assert q_len == 1 and bsz == paged_step.rows, "paged attention is for decode steps"
    kv_heads = key.shape[1]
    k = key.view(bsz, -1, kv_heads, head_dim).transpose(1, 2)  # [B, kv_heads, longest, hd]
    v = value.view(bsz, -1, kv_heads, head_dim).transpose(1, 2)
    q = query.reshape(bsz, kv_heads, heads // kv_heads, head_dim)  # [B, kv_heads, group, hd]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=paged_step.mask[query.device],
                                         scale=scaling)  # [B, kv_heads, group, hd]
    return out.reshape(bsz, 1, heads, head_dim), None  # [B, 1, heads, hd]


AttentionInterface.register(PAGED_ATTENTION, paged_attention)
AttentionMaskInterface.register(PAGED_ATTENTION, sdpa_mask)
