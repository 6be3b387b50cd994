"""Decode attention over block tables: every row attends exactly its own positions.

A decode step gathers each running sequence's keys and values from its own blocks and attends
every row in one SDPA call per layer, in one of two layouts chosen per step:

* padded (lengths alike): a ``[rows, longest, kv_heads, head_dim]`` block, a shorter row filled
  with its own first position, masked out; compute as a batch padded to the longest row;
* exact (one row far longer than the rest): exactly the rows' own positions, row after row,
  every row's queries over all of them under a block-diagonal mask; no padded copy, compute
  rows x positions.

Either way every read is of the row's own blocks (never another sequence's, never
uninitialized memory).

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


# Gather exactly (block-diagonal) when the padded block would copy more than this many
# times the positions the rows really hold.
_EXACT_OVER_PADDED = 2


@dataclass(slots=True)
class PagedDecodeStep:
    """What every layer of one decode step shares, per device that holds KV."""

    rows: int
    write_slots: dict[torch.device, torch.Tensor]  # [B]: where each row's new token goes
    read_slots: dict[torch.device, torch.Tensor]  # padded: [B * longest]; exact: [T]
    # padded: [B, 1, 1, longest] bool or None (all rows full); exact: [B, T] bool
    mask: dict[torch.device, torch.Tensor | None]
    exact: bool = False

    @classmethod
    def build(cls, cache: PagedKVCache, tables: list[list[int]],
              positions: list[int]) -> PagedDecodeStep:
        """Row ``i`` writes its new token at ``positions[i]`` and reads ``0..positions[i]``."""
        rows = len(tables)
        lengths = torch.tensor([p + 1 for p in positions])
        longest = int(lengths.max())
        per_row = [cache.slot_index(table, n)
                   for table, n in zip(tables, lengths.tolist(), strict=True)]
        write = torch.stack([slots[-1] for slots in per_row])
        exact = rows * longest > _EXACT_OVER_PADDED * int(lengths.sum())
        if exact:
            read = torch.cat(per_row)
            row_of = torch.repeat_interleave(torch.arange(rows), lengths)  # [T]
            mask: torch.Tensor | None = torch.arange(rows)[:, None] == row_of[None, :]
        else:
            read = torch.stack([torch.cat([s, s[:1].expand(longest - len(s))])
                                for s in per_row]).view(-1)
            mask = None
            if int(lengths.min()) < longest:
                mask = (torch.arange(longest)[None, :] < lengths[:, None])[:, None, None, :]
        return cls(
            rows=rows,
            write_slots={d: write.to(d) for d in cache.devices},
            read_slots={d: read.to(d) for d in cache.devices},
            mask={d: None if mask is None else mask.to(d) for d in cache.devices},
            exact=exact,
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
    bsz, heads, q_len, head_dim = query.shape
    assert q_len == 1 and bsz == paged_step.rows, "paged attention is for decode steps"
    kv_heads = key.shape[1]
    group = heads // kv_heads
    mask = paged_step.mask[query.device]
    if paged_step.exact:
        # key, value: [T, kv_heads, hd]; every row's queries over all T positions, a row's
        # mask row keeping only its own
        q = query.reshape(bsz, kv_heads, group, head_dim).transpose(0, 1)
        q = q.reshape(1, kv_heads, bsz * group, head_dim)
        out = F.scaled_dot_product_attention(
            q, key.transpose(0, 1)[None], value.transpose(0, 1)[None],
            attn_mask=mask.repeat_interleave(group, 0), scale=scaling)  # [1, kvh, B*g, hd]
        out = out.reshape(kv_heads, bsz, group, head_dim).transpose(0, 1)
        return out.reshape(bsz, 1, heads, head_dim), None  # [B, 1, heads, hd]
    # key, value: [B * longest, kv_heads, hd]
    k = key.view(bsz, -1, kv_heads, head_dim).transpose(1, 2)  # [B, kv_heads, longest, hd]
    v = value.view(bsz, -1, kv_heads, head_dim).transpose(1, 2)
    q = query.reshape(bsz, kv_heads, group, head_dim)  # [B, kv_heads, group, hd]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.reshape(bsz, 1, heads, head_dim), None  # [B, 1, heads, hd]


AttentionInterface.register(PAGED_ATTENTION, paged_attention)
AttentionMaskInterface.register(PAGED_ATTENTION, sdpa_mask)
