"""The engine's attention, for every kind of pass: decode attention over the paged pool's
block tables (every row attends exactly its own positions), prefill attention (the engine's
CPU kernel through :class:`PrefillSpan`, else the model's SDPA) and the mixed pass's
attention (:class:`MixedStep`: decode rows and prompt chunks in one pass).

A decode step gathers each running sequence's keys and values from its own blocks and attends
every row in one SDPA call per layer, in one of two layouts chosen per step:

* padded (lengths alike): a ``[rows, longest, kv_heads, head_dim]`` block, a shorter row filled
  with its own first position, masked out; compute as a batch padded to the longest row;
* exact (one row far longer than the rest): exactly the rows' own positions, row after row,
  every row's queries over all of them under a block-diagonal mask; no padded copy, compute
  rows x positions.

Either way every read is of the row's own blocks (never another sequence's, never
uninitialized memory).

On the CPU with a float32 pool (``inplace``, the default there:
``engine.kernels.attention``) neither copy is made: the engine's kernel
(``app/csrc/paged_attention.c``) reads each row's keys and values where they lie, given the
slots of every row in turn and each row's offset into them (``app.decode_attention``).

Grouped-query attention needs no repeated KV: the query heads that share a KV head become
that head's query positions (``[rows, kv_heads, group, head_dim]``).

A mixed pass (:class:`MixedStep`, the colocated engine's mixed batching) is one sequence of
tokens: the decode rows' tokens attend as above, then each prompt chunk attends its own
earlier positions and itself as a prefill pass attends it (``app.prefill_attention``).
Where the kernels serve the pass, its rows' keys and values go into the pool and into each
prompt's KV so far in one kernel call a layer each (``app.kv_cache.write_rows``), and every
group writes its output into one buffer the pass's layers share (``MixedStep.out``): torch's
indexed copies, the concatenation and their page faults cost about 0.6 ms a layer.

Registered with transformers as the attention implementation ``splitserve_paged``: any pass
without a :class:`PagedDecodeStep` or :class:`MixedStep` (prefill, ``generate()``) runs the
model's SDPA unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from app.decode_attention import decode_attention, inplace_decode_attention
from app.kv_cache import PagedKVCache, write_rows
from app.kv_package import KVLayout
from app.prefill_attention import PrefillSpan, _kernel_prefill_attention, _kernel_serves

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
    # in place (the engine's CPU kernel): read_slots are every row's slots one row after
    # another, row i's at offsets[i]..offsets[i + 1]; the pool is read where it lies
    inplace: bool = False
    offsets: torch.Tensor | None = None

    @classmethod
    def build(cls, cache: PagedKVCache, tables: list[list[int]],
              positions: list[int], inplace: bool = False) -> PagedDecodeStep:
        """Row ``i`` writes its new token at ``positions[i]`` and reads ``0..positions[i]``.
        ``inplace``: for :func:`inplace_attention_unavailable`'s kernel (CPU, float32 or bf16)."""
        rows = len(tables)
        if inplace:
            counts = [p + 1 for p in positions]
            read = cache.rows_slots(tables, counts)
            offsets = torch.from_numpy(np.cumsum([0, *counts], dtype=np.int64))
            write = read[offsets[1:] - 1]  # each row's last slot: its new token's
            return cls(rows=rows, write_slots={d: write.to(d) for d in cache.devices},
                       read_slots={d: read for d in cache.devices},
                       mask={d: None for d in cache.devices}, inplace=True, offsets=offsets)
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
        self.keeps_kv = False  # written into the pool at once

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states, value_states: [B, kv_heads, 1, head_dim]
        layer = self.layers[layer_idx]  # [2, slots, kv_heads, head_dim]
        write = self.step.write_slots[layer.device]
        write_rows(key_states[:, :, 0].transpose(0, 1), value_states[:, :, 0].transpose(0, 1),
                   layer[0], layer[1], write, kernel=self.step.inplace)
        if self.step.inplace:  # the whole pool: the kernel reads each row's own slots
            return layer[0], layer[1]
        read = self.step.read_slots[layer.device]
        # [B * longest, kv_heads, head_dim] each, in the pass's dtype
        return (layer[0].index_select(0, read).to(key_states.dtype),
                layer[1].index_select(0, read).to(value_states.dtype))


@dataclass(slots=True)
class MixedStep:
    """What every layer of one mixed pass shares: the pass is one sequence of tokens, first
    one token for each of ``rows`` decode rows (``decode``: their paged step), then prompt
    chunks of ``chunk_lens`` tokens, chunk ``i`` at positions ``past_lens[i]..``."""

    rows: int
    decode: PagedDecodeStep | None
    chunk_lens: list[int]
    past_lens: list[int]
    # per chunk: None (no past: causal) or [1, 1, n, past + n] bool, query q sees past + q
    masks: list[torch.Tensor | None]
    # the layer in progress: (decode keys, values) gathered from the pool, and per chunk its
    # (keys, values) over past + chunk; set by MixedCacheView.update, read by the attention
    current: tuple | None = None
    # the chunks attend through the engine's prefill attention kernel (else the model's SDPA),
    # with bf16 products where prefill_bf16; then, per chunk, its past length as the kernel
    # reads it ([1] int64), built once per pass
    prefill_kernel: bool = False
    kernel_starts: list[torch.Tensor] | None = None
    prefill_bf16: bool = False
    # rows' keys/values written by the engine's kernel (write_rows) where it takes them
    kv_kernel: bool = False
    # the attention's output [1, T, heads, hd], made by the first layer, reused by the next
    # (each layer's is read by its output product before the next layer's attention)
    out: torch.Tensor | None = None

    @classmethod
    def build(cls, cache: PagedKVCache, tables: list[list[int]], positions: list[int],
              chunk_lens: list[int], past_lens: list[int],
              prefill_kernel: bool = False, prefill_bf16: bool = False,
              inplace: bool = False) -> MixedStep:
        """``inplace``: the decode rows read the pool in place (``PagedDecodeStep.build``),
        and keys and values are written by the engine's kernel (which that implies)."""
        masks: list[torch.Tensor | None] = []
        for n, p in zip(chunk_lens, past_lens, strict=True):
            if p == 0:
                masks.append(None)
            else:
                q = torch.arange(n)[:, None]
                k = torch.arange(p + n)[None, :]
                masks.append((k <= p + q)[None, None])
        return cls(
            rows=len(tables),
            decode=(PagedDecodeStep.build(cache, tables, positions, inplace=inplace)
                    if tables else None),
            chunk_lens=chunk_lens, past_lens=past_lens, masks=masks,
            prefill_kernel=prefill_kernel,
            kernel_starts=([torch.tensor([p]) for p in past_lens] if prefill_kernel
                           else None),
            prefill_bf16=prefill_bf16, kv_kernel=inplace)


class MixedCacheView:
    """The cache a mixed pass hands the model's layers. ``update`` gets the pass's keys and
    values ``[1, kv_heads, T, head_dim]``: the decode rows' are written into their slots and
    their blocks gathered, or the pool handed on whole where the kernel reads it in place (as
    :class:`PagedCacheView`); a chunk with ``into`` (its prompt's KV so far with room for it,
    ``[layers, 2, kv_heads, N, head_dim]``) is written there after its past and attends over
    a view of it; the other chunks' are kept (``keys``, ``values``: per layer, the chunks'
    part, as a prefill pass keeps them) and joined after each chunk's past (per chunk, per
    layer (keys, values) ``[1, kv_heads, P, head_dim]``)."""

    def __init__(self, cache: PagedKVCache, step: MixedStep,
                 past: list[list[tuple[torch.Tensor, torch.Tensor]] | None],
                 into: list[torch.Tensor | None] | None = None) -> None:
        self.layers = cache.layers
        self.step = step
        self.past = past
        self.into = into or [None] * len(step.chunk_lens)
        # whether the layers' keys/values are read after the layer (``chunk_kvs``): where
        # they are not, the caller may hand views of a buffer it reuses
        self.keeps_kv = any(w is None for w in self.into)
        self.keys: list[torch.Tensor | None] = [None] * len(cache.layers)
        self.values: list[torch.Tensor | None] = [None] * len(cache.layers)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        step, rows = self.step, self.step.rows
        decode_kv = None
        if rows:
            assert step.decode is not None
            layer = self.layers[layer_idx]  # [2, slots, kv_heads, head_dim]
            write = step.decode.write_slots[layer.device]
            write_rows(key_states[0, :, :rows], value_states[0, :, :rows], layer[0], layer[1],
                       write, kernel=step.kv_kernel)
            if step.decode.inplace:  # the whole pool: the kernel reads each row's slots
                decode_kv = (layer[0], layer[1])
            else:
                read = step.decode.read_slots[layer.device]
                decode_kv = (layer[0].index_select(0, read).to(key_states.dtype),
                             layer[1].index_select(0, read).to(value_states.dtype))
        new_k, new_v = key_states[:, :, rows:], value_states[:, :, rows:]
        self.keys[layer_idx], self.values[layer_idx] = new_k, new_v
        chunk_kv = []
        start = 0
        for i, n in enumerate(step.chunk_lens):
            k, v = new_k[:, :, start : start + n], new_v[:, :, start : start + n]
            past, into = self.past[i], self.into[i]
            if into is not None:
                p, dst = step.past_lens[i], into[layer_idx]  # [2, kv_heads, N, head_dim]
                write_rows(k[0], v[0], dst[0, :, p:].transpose(0, 1),
                           dst[1, :, p:].transpose(0, 1), kernel=step.kv_kernel)
                k, v = dst[0, :, : p + n][None], dst[1, :, : p + n][None]
            elif past is not None:
                past_k, past_v = past[layer_idx]
                k = torch.cat([past_k.to(k), k], dim=2)
                v = torch.cat([past_v.to(v), v], dim=2)
            chunk_kv.append((k, v))
            start += n
        step.current = (decode_kv, chunk_kv)
        return key_states, value_states

    def chunk_kvs(self, layout: KVLayout, dtype: torch.dtype,
                  device: torch.device) -> list[torch.Tensor]:
        """Per chunk, its KV ``[layers, 2, kv_heads, len_i, head_dim]``: contiguous, in
        ``dtype`` on ``device``; for a chunk with ``into``, the view of it that holds them."""
        kvs, start = [], 0
        for n, p, into in zip(self.step.chunk_lens, self.step.past_lens, self.into,
                              strict=True):
            if into is not None:
                kvs.append(into[:, :, :, p : p + n])
                start += n
                continue
            kv = torch.empty((layout.num_layers, 2, layout.num_kv_heads, n, layout.head_dim),
                             dtype=dtype, device=device)
            for layer_idx in range(layout.num_layers):
                kv[layer_idx, 0] = self.keys[layer_idx][0, :, start : start + n]
                kv[layer_idx, 1] = self.values[layer_idx][0, :, start : start + n]
            kvs.append(kv)
            start += n
        return kvs


def serving_sdpa_backends(devices) -> str | None:
    """On a CUDA device, turn torch's cuDNN attention off for this process; returns why (or
    None where nothing changed). cuDNN builds an execution plan for each new shape, and a
    served pass has a new shape at nearly every call (every decode step's key length, every
    prompt's length); flash and memory-efficient attention, which torch picks instead, have
    no per-shape set-up. BENCHMARKS.md's GPU check measured the difference."""
    if not any(torch.device(d).type == "cuda" for d in devices):
        return None
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
    return "cuDNN attention off: it plans each new shape, and served shapes change every step"


def _mixed_attention(module, query, step: MixedStep, scaling, dropout, kwargs):
    """A mixed pass's attention, ``query`` [1, heads, T, hd]: the decode rows (the first
    ``step.rows`` tokens) over the paged pool, then each prompt chunk causally over its own
    earlier positions and itself, exactly as a prefill pass attends it."""
    assert step.current is not None, "the cache view runs before the attention"
    decode_kv, chunk_kv = step.current
    step.current = None
    _, heads, _, head_dim = query.shape
    rows, total = step.rows, query.shape[2]
    out = step.out  # [1, T, heads, hd]: each group's rows written in place where it can be
    if out is None or out.shape != (1, total, heads, head_dim) or out.dtype != query.dtype:
        out = step.out = query.new_empty((1, total, heads, head_dim))
    if rows:
        q = query[0, :, :rows].transpose(0, 1).unsqueeze(2)  # [B, heads, 1, hd]
        if step.decode.inplace and query.dtype == torch.float32:
            inplace_decode_attention(q, decode_kv[0], decode_kv[1], step.decode, scaling,
                                     out[0, :rows])
        else:
            out[0, :rows] = decode_attention(q, decode_kv[0], decode_kv[1], step.decode,
                                              scaling).reshape(rows, heads, head_dim)
    start = rows
    for i, ((k, v), n) in enumerate(zip(chunk_kv, step.chunk_lens, strict=True)):
        q = query[:, :, start : start + n]
        if step.prefill_kernel and _kernel_serves(q, k, kwargs):
            _kernel_prefill_attention(q, k, v, step.kernel_starts[i], step.past_lens[i],
                                      scaling, step.prefill_bf16, out[:, start : start + n])
            start += n
            continue
        mask = step.masks[i]
        if mask is not None and mask.device != query.device:
            mask = step.masks[i] = mask.to(query.device)  # moved once per device change
        out[:, start : start + n], _ = sdpa_attention_forward(
            module, q, k, v, mask, scaling=scaling, dropout=dropout, **kwargs)  # [1, n, h, hd]
        start += n
    return out, None  # [1, T, heads, hd]


def paged_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                    paged_step: PagedDecodeStep | None = None,
                    mixed_step: MixedStep | None = None,
                    prefill_span: PrefillSpan | None = None, **kwargs):
    """The model's SDPA attention, except in a decode step given a :class:`PagedDecodeStep`,
    in a mixed pass given a :class:`MixedStep`, and in a prefill pass given a
    :class:`PrefillSpan` (the engine's prefill kernel)."""
    if mixed_step is not None:
        return _mixed_attention(module, query, mixed_step, scaling, dropout, kwargs)
    if prefill_span is not None and _kernel_serves(query, key, kwargs):
        return _kernel_prefill_attention(query, key, value, prefill_span.starts,
                                         prefill_span.pmax, scaling, prefill_span.bf16), None
    if paged_step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    return decode_attention(query, key, value, paged_step, scaling), None


AttentionInterface.register(PAGED_ATTENTION, paged_attention)
AttentionMaskInterface.register(PAGED_ATTENTION, sdpa_mask)
