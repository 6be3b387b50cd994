"""What a prefill pass that continues prompts attends to: the stand-in for the model's cache
that collects each layer's new keys and values (after the rows' earlier positions), the rows'
earlier positions padded to one length, and the mask that hides the padding."""

from __future__ import annotations

import torch

from app.kv_package import KVLayout


class PrefillCollector:
    """Cache stand-in for prefill: keeps each layer's new keys/values and attends over them,
    after the row's earlier positions (``past``: per layer ``[B, kv_heads, P, head_dim]``
    keys and values) when the pass continues prompts whose start is already computed.

    ``into`` (one row continuing its prompt): the prompt's KV so far, ``[layers, 2, kv_heads,
    N, head_dim]`` in the pass's dtype with its first ``start`` positions filled and room for
    the chunk. Each layer's new keys/values are written there after them and attention reads
    a view of it, so neither the past nor the chunk is copied again (a concatenation of the
    two would copy the whole past once a layer, every pass of a long prompt)."""

    def __init__(self, num_layers: int,
                 past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 into: torch.Tensor | None = None, start: int = 0) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.past = past
        self.into, self.start = into, start
        # whether the layers' keys/values are read after the layer (``row_kvs``): with
        # ``into`` they are copied there at once, so the caller may hand views of a buffer
        self.keeps_kv = into is None
        # a pass in one kernel call without past or into: each row's KV written into a buffer
        # of its own, float32 [layers, 2, kv_heads, S, head_dim] (FusedLayers.pass_call)
        self.owned: list[torch.Tensor] | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: [B, kv_heads, S, head_dim]
        self.keys[layer_idx] = key_states
        self.values[layer_idx] = value_states
        if self.into is not None:
            end = self.start + key_states.shape[2]
            keys, values = self.into[layer_idx, 0], self.into[layer_idx, 1]
            keys[:, self.start : end] = key_states[0]
            values[:, self.start : end] = value_states[0]
            return keys[None, :, :end], values[None, :, :end]
        if self.past is None:
            return key_states, value_states
        past_k, past_v = self.past[layer_idx]
        return (torch.cat([past_k.to(key_states), key_states], dim=2),
                torch.cat([past_v.to(value_states), value_states], dim=2))

    def row_kvs(self, lens: list[int], layout: KVLayout, dtype: torch.dtype,
                device: torch.device) -> list[torch.Tensor]:
        """Per row, the KV of its new tokens only ``[layers, 2, kv_heads, len_i, head_dim]``
        (contiguous, ``dtype``, on ``device``); with ``into``, the view of it that holds them."""
        if self.into is not None:
            return [self.into[:, :, :, self.start : self.start + lens[0]]]
        if self.owned is not None:
            return [kv[:, :, :, :n].to(device, dtype).contiguous()
                    for kv, n in zip(self.owned, lens, strict=True)]
        kvs = []
        for i, n in enumerate(lens):
            kv = torch.empty((layout.num_layers, 2, layout.num_kv_heads, n, layout.head_dim),
                             dtype=dtype, device=device)
            for layer_idx in range(layout.num_layers):
                kv[layer_idx, 0] = self.keys[layer_idx][i, :, :n]
                kv[layer_idx, 1] = self.values[layer_idx][i, :, :n]
            kvs.append(kv)
        return kvs


def past_mask(starts: list[int], seq: int) -> torch.Tensor:
    """[B, 1, S, Pmax + S] bool: row i's query q sees its own ``starts[i]`` earlier
    positions (the rest of the padded past is masked) and its new tokens up to q."""
    pmax = max(starts)
    q = torch.arange(seq)[:, None]
    k = torch.arange(pmax + seq)[None, :]
    own_new = (k >= pmax) & (k - pmax <= q)  # [S, Pmax + S]
    own_past = k[None] < torch.tensor(starts)[:, None, None]  # [B, 1, Pmax + S]
    return (own_new[None] | own_past)[:, None]


def padded_past(past: list[torch.Tensor | None], starts: list[int], layout: KVLayout,
                dtype: torch.dtype, kv_device: torch.device,
                layer_devices: list[torch.device]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) ``[B, kv_heads, Pmax, head_dim]``, each on its layer's
    device, a shorter row zero-padded at the end (masked out). One row (a long prompt's
    next chunk) has nothing to pad: its layers' views of its own KV, copied only where a
    layer's device or the dtype differs."""
    if len(past) == 1 and past[0] is not None:
        return [(past[0][li, 0][None].to(dev, dtype), past[0][li, 1][None].to(dev, dtype))
                for li, dev in enumerate(layer_devices)]
    pmax = max(starts)
    padded = torch.zeros((layout.num_layers, 2, len(starts), layout.num_kv_heads, pmax,
                          layout.head_dim), dtype=dtype, device=kv_device)
    for i, kv in enumerate(past):
        if kv is not None:
            padded[:, :, i, :, : starts[i]] = kv.to(kv_device, dtype)
    return [(padded[li, 0].to(dev), padded[li, 1].to(dev))
            for li, dev in enumerate(layer_devices)]
