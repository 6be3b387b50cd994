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
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from app.cpu_kernels import assert_kernel_tensors, check, load_kernel
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


def store_rows(keys: torch.Tensor, values: torch.Tensor, dst_keys: torch.Tensor,
               dst_values: torch.Tensor, slots: torch.Tensor | None = None) -> bool:
    """A pass's rows' keys and values ``[kv_heads, n, head_dim]`` (float32, on the CPU, each
    row's head_dim contiguous) into ``dst_keys``/``dst_values`` ``[nslots, kv_heads,
    head_dim]`` (views of a pool layer, or of a prompt's KV from its next position, float32
    or bf16 on the CPU): row ``i`` into slot ``slots[i]`` (int64) or ``i``, as
    ``dst[slots] = rows.transpose(0, 1).to(dst.dtype)`` writes it, in one call of the
    engine's kernel (``kv_store_rows``; the caller knows the kernel is there) instead of a
    few torch copies. False, with nothing written, for tensors the kernel does not take
    (the caller copies them with torch)."""
    if not (keys.dtype == values.dtype == torch.float32
            and dst_keys.dtype == dst_values.dtype in (torch.float32, torch.bfloat16)
            and all(t.device.type == "cpu" for t in (keys, values, dst_keys, dst_values))
            and keys.stride() == values.stride() and dst_keys.stride() == dst_values.stride()
            and keys.stride(-1) == 1 and dst_keys.stride(-1) == 1):
        return False
    kv_heads, n, head_dim = keys.shape
    assert values.shape == keys.shape, "keys and values: one shape"
    assert dst_keys.shape == dst_values.shape and dst_keys.shape[1:] == (kv_heads, head_dim), \
        f"destination {tuple(dst_keys.shape)} for rows of {kv_heads} x {head_dim}"
    if slots is not None:
        assert_kernel_tensors(slots=(slots, torch.long))
        assert slots.numel() == n, "slots: one a row"
    check(load_kernel().kv_store_rows(
        keys.data_ptr(), values.data_ptr(), n, keys.stride(1), keys.stride(0), kv_heads,
        head_dim, None if slots is None else slots.data_ptr(), dst_keys.shape[0],
        dst_keys.data_ptr(), dst_values.data_ptr(), dst_keys.stride(0), dst_keys.stride(1),
        int(dst_keys.dtype == torch.bfloat16)), "kv_store_rows")
    return True


def write_rows(keys: torch.Tensor, values: torch.Tensor, dst_keys: torch.Tensor,
               dst_values: torch.Tensor, slots: torch.Tensor | None = None,
               kernel: bool = False) -> None:
    """Rows' keys and values into a pool layer's slots or a prompt's KV, as
    :func:`store_rows` lays them out: through the engine's kernel where ``kernel`` (the
    caller knows it is loaded) and it takes these tensors, else with torch's copies."""
    if kernel and store_rows(keys, values, dst_keys, dst_values, slots):
        return
    for src, dst in ((keys, dst_keys), (values, dst_values)):
        if slots is None:
            dst[: src.shape[1]] = src.transpose(0, 1)
        else:
            dst[slots] = src.transpose(0, 1).to(dst.dtype)


class SpareBuffers:
    """Large tensors one path makes and drops over and over (a chunked prompt's KV so far,
    ``PrefillJob.whole``: 47 MB for a 1,024-token prompt of SmolLM2), kept for the next
    instead of handed back to the allocator: a fresh buffer takes a page fault per 4 KB at
    its first write (about 3 us each on a 2-core VM, 0.3 ms a layer of a 256-token chunk),
    a reused one none. Holds at most ``count`` buffers, ``max_bytes`` in all."""

    def __init__(self, count: int = 4, max_bytes: int = 1 << 30) -> None:
        self.count, self.max_bytes = count, max_bytes
        self._free: list[torch.Tensor] = []  # 1-D buffers
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device | str) -> torch.Tensor:
        """A contiguous ``shape`` tensor (uninitialised): a view of the smallest spare that
        holds it, else of a new buffer (which :meth:`give` can keep once it is dropped)."""
        need = math.prod(shape)
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.dtype == dtype
                    and b.device == torch.device(device) and b.numel() >= need]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                return buf[:need].view(shape)
        return torch.empty(need, dtype=dtype, device=device).view(shape)

    def give(self, tensor: torch.Tensor) -> None:
        """``tensor`` (from :meth:`take`; nothing else may use it from now on) kept for a
        later take while there is room; others are left to the allocator."""
        buf = tensor._base if tensor._base is not None else tensor
        if buf.dim() != 1:
            return
        with self._lock:
            kept = sum(b.numel() * b.element_size() for b in self._free)
            if (len(self._free) < self.count and all(b is not buf for b in self._free)
                    and kept + buf.numel() * buf.element_size() <= self.max_bytes):
                self._free.append(buf)

