"""Forward passes for the two phases over a Hugging Face decoder-only model.

The runner drives the model's own modules (embedding, rotary embedding, decoder layers, final
norm, LM head) so the arithmetic is the model's, while KV storage is the runner's:

* ``prefill``: a right-padded batch of prompts in one causal pass; each prompt's keys and
  values come back as one contiguous ``[layers, 2, kv_heads, seq, head_dim]`` tensor.
* ``decode``: one token for each active row of a preallocated batch KV buffer
  ``[layers, 2, rows, kv_heads, capacity, head_dim]``; rows may hold different lengths, each
  new key/value is written in place at its row's own position.

A model spread over several GPUs (``device_map``) keeps each layer's KV on that layer's GPU:
the batch buffer is one part per run of consecutive layers on one device, so the decode hot
path never moves KV between devices; only the hidden state crosses at a device boundary.
Inputs go to the embedding's device, logits come from the LM head's device.
"""

from __future__ import annotations

import inspect
import itertools
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from app.config import EngineConfig, dtype_name
from app.kv_package import KVLayout
from app.model_loader import ModelShape, check_architecture

# KV positions per row are reserved in steps of this many tokens: a power-of-two rounding
# nearly doubled a buffer (and the stall of growing it) for a reservation just past 2^k.
_CAPACITY_STEP = 128


# What one extra attention call for a single row costs, in attended positions of the batch:
# on a CPU core about a millisecond per step over 30 layers, the time to read ~500
# positions; on a GPU a kernel launch per layer costs as much as reading thousands (a guess
# kept conservative until measured there: it only splits steps with a large outlier).
_ROW_CALL_POSITIONS_CPU = 512
_ROW_CALL_POSITIONS_ACCELERATOR = 8192
# Split a decode step's attention only when it reads at most this share of the padded batch.
_RAGGED_MAX_SHARE = 0.75
RAGGED_ATTENTION = "splitserve_ragged"


@dataclass(frozen=True, slots=True)
class RaggedDecode:
    """How a decode step attends rows of very different lengths without reading every row to
    the longest: all rows attend their first ``span`` positions in one call (shorter rows
    masked to their length), then each of ``long_rows`` (row, length), the rows longer than
    ``span``, is attended alone over its whole length and replaces its row of the result."""

    span: int
    long_rows: tuple[tuple[int, int], ...]


def plan_ragged(lengths: list[int], row_call_positions: int) -> RaggedDecode | None:
    """The cheapest split of a step's attention (positions read, plus ``row_call_positions``
    per row attended alone), or None when one padded call over the longest row is about as
    cheap."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows = len(lengths)
    padded = rows * lengths[order[0]]
    best_cost, best_k, alone = padded, 0, 0
    for k in range(1, rows):
        alone += lengths[order[k - 1]] + row_call_positions
        cost = rows * lengths[order[k]] + alone
        if cost < best_cost:
            best_cost, best_k = cost, k
    if best_k == 0 or best_cost > _RAGGED_MAX_SHARE * padded:
        return None
    return RaggedDecode(lengths[order[best_k]],
                        tuple((i, lengths[i]) for i in order[:best_k]))


def ragged_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                     ragged_decode: RaggedDecode | None = None, **kwargs):
    """The model's SDPA attention, except in a decode step given a :class:`RaggedDecode`.

    Registered with transformers as ``splitserve_ragged``; the runner selects it for models
    that use SDPA, so every pass but a planned decode step runs SDPA unchanged.
    """
    if ragged_decode is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    # query: [B, heads, 1, hd]; key, value: [B, kv_heads, longest, hd] (batch-buffer views);
    # attention_mask: [B, 1, 1, span] or None. Query heads sharing a KV head become that
    # head's "positions" ([B, kv_heads, group, hd]) so no KV is repeated.
    bsz, heads, q_len, head_dim = query.shape
    assert q_len == 1, "a ragged plan is for decode steps only"
    kv_heads = key.shape[1]
    q = query.reshape(bsz, kv_heads, heads // kv_heads, head_dim)
    span = ragged_decode.span
    out = F.scaled_dot_product_attention(q, key[:, :, :span], value[:, :, :span],
                                         attn_mask=attention_mask, scale=scaling)
    for row, n in ragged_decode.long_rows:
        out[row : row + 1] = F.scaled_dot_product_attention(
            q[row : row + 1], key[row : row + 1, :, :n], value[row : row + 1, :, :n],
            scale=scaling)
    return out.reshape(bsz, heads, 1, head_dim).transpose(1, 2), None


AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)


class _PrefillCollector:
    """Cache stand-in for prefill: keeps each layer's keys/values, attends over them as is."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: [B, kv_heads, S, head_dim]
        self.keys[layer_idx] = key_states
        self.values[layer_idx] = value_states
        return key_states, value_states


@dataclass(frozen=True, slots=True)
class LayerSpan:
    """Layers ``start..stop-1``, consecutive and on one device: their KV shares one buffer."""

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


@dataclass(slots=True)
class BatchKV:
    """The decoder's KV buffer; ``rows * capacity`` is bounded by the engine's KV budget.

    One part per :class:`LayerSpan`, on that span's device (a single part on one device).
    """

    parts: list[torch.Tensor]  # per span: [span_layers, 2, rows, kv_heads, capacity, head_dim]
    layers: list[torch.Tensor] = field(init=False)  # per layer: [2, rows, kvh, cap, hd] views

    def __post_init__(self) -> None:
        self.layers = [layer for part in self.parts for layer in part.unbind(0)]

    @property
    def rows(self) -> int:
        return int(self.parts[0].shape[2])

    @property
    def capacity(self) -> int:
        return int(self.parts[0].shape[4])


class _BatchCacheView:
    """Cache stand-in for decode: writes one token per row into the batch buffer in place."""

    def __init__(self, kv: BatchKV, rows: int, positions: torch.Tensor, span: int) -> None:
        self.layers = kv.layers
        self.rows = rows
        self.span = span
        # (row index, positions) on each device that holds KV: [B] each
        self.index = {
            device: (torch.arange(rows, device=device), positions.to(device))
            for device in {part.device for part in kv.parts}
        }

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: [B, kv_heads, 1, head_dim], on the layer's device and in the buffer's
        # dtype (the model's), so attention reads the buffer in place, with no per-step copy
        buf = self.layers[layer_idx]  # [2, rows, kv_heads, capacity, head_dim]
        row_idx, positions = self.index[buf.device]
        keys, values = buf[0], buf[1]
        keys[row_idx, :, positions] = key_states[:, :, 0]
        values[row_idx, :, positions] = value_states[:, :, 0]
        return keys[: self.rows, :, : self.span], values[: self.rows, :, : self.span]


def _module_device(module: torch.nn.Module, default: torch.device | None = None) -> torch.device:
    """Where a module's weights (or, lacking any, its buffers) live."""
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
    if tensor is None:
        assert default is not None, f"{type(module).__name__} holds no tensors"
        return default
    return tensor.device


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def round_capacity(n: int) -> int:
    """KV positions reserved per row for a need of ``n``: a multiple of 128."""
    return max(1, -(-n // _CAPACITY_STEP)) * _CAPACITY_STEP


def round_rows(n: int) -> int:
    """Rows of a batch buffer for ``n`` sequences: 1, 2, 4, then multiples of 4."""
    return _next_pow2(n) if n <= 4 else -(-n // 4) * 4


class ModelRunner:
    """Runs prefill and decode forward passes; owns no request state."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        check_architecture(model)
        self.model = model
        self.config = config
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = model.lm_head
        cfg = model.config
        self.shape = ModelShape.from_hf_config(cfg, config.max_model_len)
        self.vocab_size = self.shape.vocab_size
        self.device = _module_device(self.embed_tokens)  # token ids go here
        self.layer_devices = [_module_device(layer) for layer in self.layers]
        self.spans = layer_spans(self.layer_devices)
        self.kv_device = self.spans[0].device  # where a KV package is loaded first
        self.output_device = _module_device(self.lm_head)  # logits come from here
        self._rotary_device = _module_device(self.rotary_emb, default=self.device)
        self._norm_device = _module_device(self.norm)
        self.multi_device = len({self.device, self.output_device, self._rotary_device,
                                 self._norm_device, *self.layer_devices}) > 1
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = config.torch_kv_dtype
        self.layout = KVLayout(
            num_layers=self.shape.num_layers,
            num_kv_heads=self.shape.num_kv_heads,
            head_dim=self.shape.head_dim,
            kv_dtype=dtype_name(self.kv_dtype),
        )
        self.max_model_len = self.shape.max_model_len
        # transformers renamed the layers' cache argument; pass it under whichever name it has.
        params = inspect.signature(self.layers[0].forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # One forward pass at a time: prefill and decode share the cores of this process.
        self.lock = threading.Lock()
        # Decode steps with rows of very different lengths attend each row to its own length
        # (RaggedDecode); any other pass is the model's SDPA. Models on another attention
        # implementation keep it, with padded decode steps.
        if getattr(cfg, "_attn_implementation", None) in ("sdpa", RAGGED_ATTENTION):
            model.set_attn_implementation(RAGGED_ATTENTION)
        self.ragged = getattr(cfg, "_attn_implementation", None) == RAGGED_ATTENTION
        self.row_call_positions = (_ROW_CALL_POSITIONS_CPU if self.kv_device.type == "cpu"
                                   else _ROW_CALL_POSITIONS_ACCELERATOR)

    def _layers_forward(self, hidden, position_ids, mask, cache,
                        **attention_kwargs) -> torch.Tensor:
        if self.multi_device:
            cos_sin = self.rotary_emb(hidden.to(self._rotary_device),
                                      position_ids.to(self._rotary_device))
        else:
            cos_sin = self.rotary_emb(hidden, position_ids)
        for layer, device in zip(self.layers, self.layer_devices, strict=True):
            if self.multi_device and hidden.device != device:
                # a device_map boundary: what the layer reads moves to its GPU
                hidden, position_ids = hidden.to(device), position_ids.to(device)
                mask = mask.to(device) if mask is not None else None
            if self.multi_device and cos_sin[0].device != device:
                cos_sin = (cos_sin[0].to(device), cos_sin[1].to(device))
            out = layer(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                position_embeddings=cos_sin,
                **{self._cache_kw: cache},
                **attention_kwargs,
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, H] -> logits [B, V] in float32, on the LM head's device
        if self.multi_device:
            hidden = self.norm(hidden.to(self._norm_device))
            return self.lm_head(hidden.to(self.output_device)).float()
        return self.lm_head(self.norm(hidden)).float()

    @torch.inference_mode()
    def forward_prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run prompts of any lengths as one right-padded batch.

        Returns logits at each prompt's last token [B, V] (float32) and, per prompt, its KV
        ``[layers, 2, kv_heads, len_i, head_dim]`` (contiguous, KV dtype, on ``kv_device``).
        Right padding needs no attention mask: under the causal mask a real token never sees
        the pads that follow it.
        """
        lens = [len(p) for p in prompts]
        bsz, seq = len(prompts), max(lens)
        ids = torch.zeros((bsz, seq), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(self.device)
        positions = torch.arange(seq, device=self.device).unsqueeze(0).expand(bsz, seq)
        collector = _PrefillCollector(len(self.layers))
        with self.lock:
            hidden = self.embed_tokens(ids)  # [B, S, H]
            hidden = self._layers_forward(hidden, positions, None, collector)
            last = torch.tensor(lens, device=hidden.device) - 1
            logits = self._logits(hidden[torch.arange(bsz, device=hidden.device), last])
            kvs = []
            lay = self.layout
            for i, n in enumerate(lens):
                kv = torch.empty(
                    (lay.num_layers, 2, lay.num_kv_heads, n, lay.head_dim),
                    dtype=self.kv_dtype,
                    device=self.kv_device,
                )
                for layer_idx in range(lay.num_layers):
                    kv[layer_idx, 0] = collector.keys[layer_idx][i, :, :n]
                    kv[layer_idx, 1] = collector.values[layer_idx][i, :, :n]
                kvs.append(kv)
        return logits, kvs

    # ---- decode -------------------------------------------------------------------------

    def kv_tokens_for(self, rows: int, capacity: int) -> int:
        return round_rows(rows) * round_capacity(capacity)

    def allocate(self, rows: int, capacity: int, old: BatchKV | None = None) -> BatchKV:
        """A buffer with at least ``rows`` rows and ``capacity`` positions (rounded by
        ``round_rows`` and ``round_capacity``), holding the first ``old.rows`` rows of ``old``
        when given."""
        rows = round_rows(rows)
        capacity = min(round_capacity(capacity), round_capacity(self.max_model_len))
        lay = self.layout
        parts = []
        for i, span in enumerate(self.spans):
            # The model's dtype, not the KV package's: a package is cast once when it joins
            # (load_row), never on every step. What is not copied from ``old`` is zeroed, each
            # byte written once: positions past a row's length are masked in attention but
            # still multiplied by 0 there, and garbage could be NaN (NaN*0=NaN).
            part = torch.empty(
                (span.stop - span.start, 2, rows, lay.num_kv_heads, capacity, lay.head_dim),
                dtype=self.dtype,
                device=span.device,
            )
            if old is None:
                part.zero_()
            else:
                r, c = min(rows, old.rows), min(capacity, old.capacity)
                part[:, :, :r, :, :c] = old.parts[i][:, :, :r, :, :c]
                part[:, :, :r, :, c:].zero_()
                part[:, :, r:].zero_()
            parts.append(part)
        return BatchKV(parts)

    def load_row(self, kv: BatchKV, row: int, package_kv: torch.Tensor) -> None:
        # package_kv: [layers, 2, kv_heads, n, head_dim], best on kv_device; each span's
        # layers are copied (and cast to the model's dtype) onto that span's device
        n = package_kv.shape[3]
        for span, part in zip(self.spans, kv.parts, strict=True):
            part[:, :, row, :, :n] = package_kv[span.start : span.stop]

    @staticmethod
    def move_row(kv: BatchKV, src: int, dst: int, length: int) -> None:
        for part in kv.parts:
            part[:, :, dst, :, :length] = part[:, :, src, :, :length]

    @torch.inference_mode()
    def decode(self, kv: BatchKV, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step for rows ``0..B-1``: row i feeds ``token_ids[i]`` at ``positions[i]``
        (its current KV length) and its new key/value is written there. Returns [B, V] float32.
        """
        bsz = len(token_ids)
        assert 0 < bsz <= kv.rows and len(positions) == bsz
        span = max(positions) + 1
        assert span <= kv.capacity, f"position {span - 1} outside KV capacity {kv.capacity}"
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device).unsqueeze(1)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        plan = (plan_ragged([p + 1 for p in positions], self.row_call_positions)
                if self.ragged else None)
        attended = plan.span if plan is not None else span
        mask = None
        if min(positions) < attended - 1:
            # rows shorter than the attended span must not see positions past their length
            key_pos = torch.arange(attended, device=self.device)
            mask = (key_pos.unsqueeze(0) <= pos.unsqueeze(1))[:, None, None, :]  # [B,1,1,span]
        view = _BatchCacheView(kv, bsz, pos, span)
        extra = {} if plan is None else {"ragged_decode": plan}
        with self.lock:
            hidden = self.embed_tokens(ids)  # [B, 1, H]
            hidden = self._layers_forward(hidden, pos.unsqueeze(1), mask, view, **extra)
            return self._logits(hidden[:, -1])
