"""Paged KV for the decode batch: a pool of fixed-size blocks and a block table per sequence.

``BlockAllocator`` is the bookkeeping (which blocks are free), ``PagedKVCache`` the storage:
per layer one tensor of ``num_blocks * block_size`` slots, a slot holding one token's keys
and values. A sequence joining copies its KV package into free blocks; a sequence leaving
hands its blocks back; nothing else moves. Token ``p`` of a sequence lives in slot
``table[p // block_size] * block_size + p % block_size``.

A model spread over several GPUs keeps each run of layers on one device (``LayerSpan``): the
pool is one tensor per span, on that span's device, so KV never crosses devices.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from app.kv_package import KVLayout

# Tokens per block. Small blocks waste little memory at a sequence's end (half a block on
# average); the gather that reads a sequence's KV works per token, so nothing is gained by
# larger ones here.
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class LayerSpan:
    """Layers ``start..stop-1``, consecutive and on one device: their KV shares one tensor."""

    start: int
    stop: int
    device: torch.device


def layer_spans(devices: list[torch.device]) -> list[LayerSpan]:
    """Group per-layer devices into runs; one span for a model on a single device."""
    spans: list[LayerSpan] = []
    for i, device in enumerate(devices):
        if spans and spans[-1].device == device:
            spans[-1] = LayerSpan(spans[-1].start, i + 1, device)
        else:
            spans.append(LayerSpan(i, i + 1, device))
    return spans


class BlockAllocator:
    """Which of ``num_blocks`` blocks are free. The lowest free block goes first, so a pool
    that is mostly idle touches (and keeps resident) only its first pages."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one token, got {num_blocks} x "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))  # a heap

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} KV blocks asked for, {len(self._free)} free")
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            heapq.heappush(self._free, b)


class PagedKVCache:
    """The block pool's storage, in the runner's ``pool_dtype``: per layer ``[2, slots, kv_heads,
    head_dim]`` (keys, values), ``slots = num_blocks * block_size``.

    On the CPU the pool is reserved, not written: pages are touched only as blocks fill.
    """

    def __init__(self, layout: KVLayout, spans: list[LayerSpan], num_blocks: int,
                 block_size: int, dtype: torch.dtype) -> None:
        self.layout = layout
        self.spans = spans
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.parts = [
            torch.empty((s.stop - s.start, 2, self.num_slots, layout.num_kv_heads,
                         layout.head_dim), dtype=dtype, device=s.device)
            for s in spans
        ]
        # per layer: [2, slots, kv_heads, head_dim] views
        self.layers = [layer for part in self.parts for layer in part.unbind(0)]
        self.devices = sorted({s.device for s in spans}, key=str)

    def _check(self, table: list[int], n: int) -> None:
        """``IndexError`` where the table's blocks hold fewer than ``n`` positions or name a
        block outside the pool."""
        if n > len(table) * self.block_size:
            raise IndexError(f"{n} positions need {-(-n // self.block_size)} blocks, the "
                             f"table has {len(table)}")
        blocks = self.num_slots // self.block_size
        if table and not 0 <= min(table) <= max(table) < blocks:
            raise IndexError(f"a block outside the pool's {blocks}: {table}")

    def slot_index(self, table: list[int], n: int) -> torch.Tensor:
        """Slots of positions ``0..n-1`` of a sequence with block table ``table``: [n].
        ``IndexError`` where the table's blocks hold fewer than ``n`` positions or name a
        block outside the pool (the kernels read the pool at these slots)."""
        return self.rows_slots([table], [n])

    def rows_slots(self, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """Every row's :meth:`slot_index` (row ``i``: positions ``0..lengths[i]-1`` of
        ``tables[i]``), one row after another: [sum(lengths)], built in numpy (a decode
        step's rows in a third of the time torch took a row at a time)."""
        bs, parts = self.block_size, []
        for table, n in zip(tables, lengths, strict=True):
            self._check(table, n)
            blocks = np.asarray(table[:-(-n // bs)], dtype=np.int64)
            parts.append((blocks[:, None] * bs + np.arange(bs)).reshape(-1)[:n])
        if not parts:
            return torch.empty(0, dtype=torch.long)
        return torch.from_numpy(np.concatenate(parts))

    def slots(self, table: list[int], start: int, stop: int) -> list[int]:
        """Slots of positions ``start..stop-1`` (a list: tests, debugging)."""
        return self.slot_index(table, stop)[start:].tolist()

    def runs(self, table: list[int], n: int) -> list[tuple[int, int, int]]:
        """Positions ``0..n-1`` of ``table`` as runs of consecutive slots: ``(slot, position,
        length)``, one per stretch of consecutive blocks (a fresh table is mostly one).
        ``IndexError`` as :meth:`slot_index`."""
        self._check(table, n)
        out: list[tuple[int, int, int]] = []
        for i, block in enumerate(table[: -(-n // self.block_size)]):
            pos = i * self.block_size
            take = min(self.block_size, n - pos)
            if out and out[-1][0] + out[-1][2] == block * self.block_size:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + take)
            else:
                out.append((block * self.block_size, pos, take))
        return out

    def write(self, table: list[int], package_kv: torch.Tensor) -> None:
        """Copy a KV package (``[layers, 2, kv_heads, n, head_dim]``) into the sequence's
        first ``n`` positions, cast to the pool's dtype, each span's layers on its device:
        one slice copy per run of consecutive blocks (a scatter through an index of every
        slot took about 9x as long on the CPU: BENCHMARKS.md section 1)."""
        n = package_kv.shape[3]
        runs = self.runs(table, n)
        for span, part in zip(self.spans, self.parts, strict=True):
            # [span_layers, 2, kv_heads, n, hd] -> [span_layers, 2, n, kv_heads, hd]
            src = package_kv[span.start : span.stop].transpose(2, 3).to(part.device)
            for slot, pos, take in runs:
                part[:, :, slot : slot + take].copy_(src[:, :, pos : pos + take])

    def read(self, table: list[int], n: int) -> torch.Tensor:
        """A sequence's first ``n`` positions as a package-shaped tensor
        ``[layers, 2, kv_heads, n, head_dim]`` on the first span's device (tests, debugging)."""
        out = []
        for span, part in zip(self.spans, self.parts, strict=True):
            index = self.slot_index(table, n).to(span.device)
            out.append(part[:, :, index].transpose(2, 3).to(self.spans[0].device))
        return torch.cat(out, 0)


def contiguous_tables(rows: int, tokens: int, block_size: int) -> list[list[int]]:
    """Block tables for ``rows`` sequences of up to ``tokens`` tokens each, laid out one after
    another (benchmarks that fill a pool directly)."""
    per_row = -(-tokens // block_size)
    return [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
