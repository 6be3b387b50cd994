"""Prefix cache for prefill: the KV of recently seen prompt prefixes, block by block.

A prompt's tokens are cut into blocks of ``block_size``; block ``i`` is keyed by the key of
block ``i - 1`` and its own token ids (a chain, rooted in the model's fingerprint), so a key
names a whole prefix, not a block's tokens alone. A new prompt's longest run of cached
blocks from its start is its cached prefix; only the rest is computed. An entry keeps its
parent's key and its tokens and a lookup compares both, so a hash collision can never hand
a prompt another prompt's KV.

Entries live under a byte budget, least recently used first out. A lookup refreshes the
blocks it matched from the last to the first, so a prefix's first blocks are always the
most recent of its chain: eviction takes a chain from its end, and no cached block is left
unreachable behind an evicted parent.

Thread-safe: the event loop looks prompts up when they arrive, the engine thread inserts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

DEFAULT_BLOCK_TOKENS = 16


@dataclass(slots=True)
class _Entry:
    parent: int
    tokens: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2, kv_heads, block_size, head_dim]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A prompt's cached prefix: ``blocks`` in order, ``tokens`` positions in all."""

    blocks: tuple[torch.Tensor, ...]
    tokens: int

    def kv(self) -> torch.Tensor | None:
        """The prefix's KV ``[layers, 2, kv_heads, tokens, head_dim]`` (None when empty)."""
        return torch.cat(self.blocks, dim=3) if self.blocks else None


class PrefixCache:
    def __init__(self, fingerprint: str, max_bytes: int,
                 block_size: int = DEFAULT_BLOCK_TOKENS) -> None:
        if block_size < 1 or max_bytes < 0:
            raise ValueError(f"block_size must be >= 1 and max_bytes >= 0, got "
                             f"{block_size}, {max_bytes}")
        self.block_size = block_size
        self.max_bytes = max_bytes
        self._root = hash(("splitserve-prefix", fingerprint))
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, found cached
        self.evictions = 0  # blocks evicted

    def __len__(self) -> int:
        return len(self._entries)

    def _keys(self, tokens: tuple[int, ...], blocks: int) -> list[tuple[int, int, tuple]]:
        """(key, parent key, block tokens) of the first ``blocks`` full blocks."""
        out, parent, bs = [], self._root, self.block_size
        for i in range(blocks):
            block = tokens[i * bs : (i + 1) * bs]
            key = hash((parent, block))
            out.append((key, parent, block))
            parent = key
        return out

    def match(self, tokens: tuple[int, ...]) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` that leaves at least one token to compute
        (the last prompt token's logits give the first output token)."""
        usable = (len(tokens) - 1) // self.block_size
        found: list[tuple[int, _Entry]] = []
        with self._lock:
            for key, parent, block in self._keys(tokens, usable):
                entry = self._entries.get(key)
                if entry is None or entry.parent != parent or entry.tokens != block:
                    break
                found.append((key, entry))
            for key, _ in reversed(found):  # the first block ends up the most recent
                self._entries.move_to_end(key)
            self.queried_tokens += len(tokens)
            self.hit_tokens += len(found) * self.block_size
        return PrefixMatch(tuple(e.kv for _, e in found), len(found) * self.block_size)

    def insert(self, tokens: tuple[int, ...], kv: torch.Tensor) -> int:
        """Cache the full blocks of a prompt whose KV is ``kv`` (``[layers, 2, kv_heads, n,
        head_dim]``, ``n >= len(tokens)`` positions of it used). Returns blocks added."""
        if self.max_bytes == 0:
            return 0
        bs = self.block_size
        chain = self._keys(tokens, min(len(tokens), kv.shape[3]) // bs)
        added = 0
        with self._lock:
            for i, (key, parent, block) in enumerate(chain):
                if key in self._entries:
                    continue
                part = kv[:, :, :, i * bs : (i + 1) * bs].clone()
                self._entries[key] = _Entry(parent, block, part)
                self.bytes += part.numel() * part.element_size()
                added += 1
            for key, _, _ in reversed(chain):  # first blocks most recent, as in match()
                self._entries.move_to_end(key)
            self._evict()
        return added

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._entries:
            _, entry = self._entries.popitem(last=False)
            self.bytes -= entry.kv.numel() * entry.kv.element_size()
            self.evictions += 1

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
