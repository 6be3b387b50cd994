"""Forward passes for the two phases over a Hugging Face decoder-only model.

The runner drives the model's own modules (embedding, rotary embedding, decoder layers, final
norm, LM head) so the arithmetic is the model's, while KV storage is the runner's:

* ``forward_prefill``: a right-padded batch of prompts in one causal pass; each prompt's keys
  and values come back as one contiguous ``[layers, 2, kv_heads, seq, head_dim]`` tensor.
* ``decode``: one token for each running sequence, over the paged KV pool
  (``app.kv_cache``): each new key/value is written into its sequence's next slot and each
  row attends only its own blocks (``app.attention``). A Llama-style model with
  panel-packed linears runs the step's layers as one call to the fused kernel
  (``app.fused_decode``) instead of its modules.
* ``forward_mixed``: both in one pass (the colocated engine's mixed batch): the decode rows'
  tokens and prompt chunks as one sequence of tokens, so every weight is read once for all
  of them; each decode row attends its blocks as in ``decode``, each chunk its own earlier
  positions and itself as in ``forward_prefill``, whose KV it returns the same way.

A model spread over several GPUs (``device_map``) keeps each layer's KV on that layer's GPU:
the pool is one tensor per run of consecutive layers on one device, so the decode hot path
never moves KV between devices; only the hidden state crosses at a device boundary. Inputs
go to the embedding's device, logits come from the LM head's device.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
from collections.abc import Generator
from typing import TypeVar

import torch

from app.attention import (
    PAGED_ATTENTION,
    MixedCacheView,
    MixedStep,
    PagedCacheView,
    PagedDecodeStep,
    serving_sdpa_backends,
)
from app.config import EngineConfig, dtype_name
from app.cpu_kernels import vector_path
from app.decode_attention import inplace_attention_unavailable
from app.fused_decode import (
    FusedDecode,
    fused_decode_unavailable,
    fused_layers_unavailable,
    layer_weights,
)
from app.fused_layers import FusedLayers
from app.kv_cache import PagedKVCache, layer_spans
from app.kv_package import KVLayout
from app.model_loader import ModelShape, check_architecture
from app.packed_linear import weight_kind
from app.prefill_attention import (
    PrefillSpan,
    bf16_attention_unavailable,
    prefill_attention_unavailable,
)
from app.prefill_inputs import PrefillCollector, padded_past, past_mask

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _to_the_end(steps: Generator[int, None, T]) -> T:
    """Run a generator of steps (a pass's layers) to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _module_device(module: torch.nn.Module, default: torch.device | None = None) -> torch.device:
    """Where a module's weights (or, lacking any, its buffers) live."""
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
    if tensor is None:
        assert default is not None, f"{type(module).__name__} holds no tensors"
        return default
    return tensor.device


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
        self.dtype = model.get_input_embeddings().weight.dtype  # what it computes in
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
        # Held by every pass but a prefill replica's lanes running side by side
        # (Prefiller.advance(alone=False)): decode, mixed and other prefill passes run one at
        # a time, as they share the cores of this process and the paged pool.
        self.lock = threading.Lock()
        # Decode steps attend over the paged pool (app.attention); every other pass
        # (prefill) is the model's SDPA through the same registered function.
        model.set_attn_implementation(PAGED_ATTENTION)
        self._choose_paths()
        self._log_paths()

    def _choose_paths(self) -> None:
        """Each part's path: the engine's kernels where config and model allow, else why."""
        config, devices = self.config, [span.device for span in self.spans]
        sdpa_note = serving_sdpa_backends(devices)
        if sdpa_note:
            logger.info("%s", sdpa_note)
        # decode attention reads the pool in place with the engine's CPU kernel where it can;
        # the pool then holds the KV dtype (bf16: half the bytes a step reads), else the
        # model's compute dtype
        kernels = config.kernels
        reason = (None if kernels.attention else "turned off (kernels.attention: false)")
        pool = self.kv_dtype if self.kv_dtype in (torch.float32, torch.bfloat16) else self.dtype
        self.inplace_reason = reason or inplace_attention_unavailable(
            pool, devices, self.shape.head_dim, config.resolved_cache_dir, self.dtype)
        self.inplace_attention = self.inplace_reason is None
        self.pool_dtype = pool if self.inplace_attention else self.dtype
        # prefill passes (and mixed passes' chunks) attend through the engine's kernel
        self.prefill_attention_reason = reason or prefill_attention_unavailable(
            self.dtype, devices, self.shape.head_dim, config.resolved_cache_dir)
        self.prefill_kernel = self.prefill_attention_reason is None
        # with bf16 products where the engine serves bf16 through the CPU's bf16 dot product
        self.prefill_bf16 = (self.prefill_kernel
                             and bf16_attention_unavailable(weight_kind(self.model)) is None)
        # the layers of other passes in two kernel calls each, and the whole decode step in
        # one, where the model is one they compute (one weight table for both)
        reason = None if kernels.fused_layers else "turned off (kernels.fused_layers: false)"
        self.fused_layers_reason = reason or fused_layers_unavailable(self.model)
        reason = None if kernels.fused_decode else "turned off (kernels.fused_decode: false)"
        self.fused_reason = reason or fused_decode_unavailable(self.model,
                                                               self.inplace_attention)
        weights = (layer_weights(self.model) if None in (self.fused_reason,
                                                         self.fused_layers_reason) else None)
        self.fused = FusedDecode(self.model, weights) if self.fused_reason is None else None
        self.fused_layers = (FusedLayers(self.model, weights)
                             if self.fused_layers_reason is None else None)

    def _log_paths(self) -> None:
        """Each part's path at start-up: a slow path the config did not ask for is a WARNING
        with its reason (a replica that could not build or load the kernels says so)."""
        vectors = self.kernel_paths()["vectors"]
        for part, why, slow in (
                ("decode attention", self.inplace_reason, "a gathered copy and SDPA"),
                ("prefill attention", self.prefill_attention_reason, "the model's SDPA"),
                ("decode steps", self.fused_reason, "the model's modules"),
                ("prefill and mixed passes' layers", self.fused_layers_reason,
                 "the model's modules")):
            if why is None:
                logger.info("%s run in the engine's kernels (%s)", part, vectors)
            else:
                level = logging.INFO if why.startswith("turned off") else logging.WARNING
                logger.log(level, "%s run through %s: %s", part, slow, why)

    def kernel_paths(self) -> dict[str, str]:
        """Which path each part runs (the ``splitserve_kernel_path`` gauge's labels)."""
        kind = weight_kind(self.model)
        return {"linear": f"panels_{kind}" if kind else "torch",
                "decode_attention": "kernel" if self.inplace_attention else "torch",
                "prefill_attention": ("kernel_bf16" if self.prefill_bf16 else "kernel")
                if self.prefill_kernel else "torch",
                "decode_step": "fused" if self.fused is not None else "modules",
                "pass_layers": "fused" if self.fused_layers is not None else "modules",
                "vectors": vector_path(self.config.resolved_cache_dir)
                if self.config.device == "cpu" else "none"}

    def _layers_forward(self, hidden, position_ids, mask, cache,
                        **attention_kwargs) -> torch.Tensor:
        return _to_the_end(self._layers(hidden, position_ids, mask, cache, **attention_kwargs))

    def _layers(self, hidden, position_ids, mask, cache,
                **attention_kwargs) -> Generator[int, None, torch.Tensor]:
        """The decoder layers over ``hidden``, yielding after each (layers done so far);
        returns the last layer's hidden states."""
        if self.multi_device:
            cos_sin = self.rotary_emb(hidden.to(self._rotary_device),
                                      position_ids.to(self._rotary_device))
        else:
            cos_sin = self.rotary_emb(hidden, position_ids)
        fused = self.fused_layers
        if fused is not None and not self.multi_device and fused.serves(hidden):
            return (yield from fused.run_layers(hidden, cos_sin, mask, cache,
                                                **attention_kwargs))
        for index, (layer, device) in enumerate(zip(self.layers, self.layer_devices,
                                                    strict=True)):
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
            yield index + 1
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, H] -> logits [B, V] in float32, on the LM head's device
        if self.multi_device:
            hidden = self.norm(hidden.to(self._norm_device))
            return self.lm_head(hidden.to(self.output_device)).float()
        return self.lm_head(self.norm(hidden)).float()

    def forward_prefill(self, prompts: list[list[int]],
                        past: list[torch.Tensor | None] | None = None,
                        into: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`prefill_layers` to the end, under the runner's lock."""
        steps = self.prefill_layers(prompts, past, into)
        with self.lock:
            return _to_the_end(steps)

    @torch.inference_mode()
    def prefill_layers(self, prompts: list[list[int]],
                       past: list[torch.Tensor | None] | None = None,
                       into: torch.Tensor | None = None,
                       ) -> Generator[int, None, tuple[torch.Tensor, list[torch.Tensor]]]:
        """:meth:`forward_prefill` as a generator that yields after each layer (the number of
        layers done), so that a pass can pause between layers for another (a short prompt
        that should not wait for a long one's whole pass) and resume; its result is the
        generator's return value. Passes paused at once share nothing but the model. The
        caller holds the runner's lock while it advances one (:meth:`forward_prefill`,
        ``Prefiller.advance``), except a prefill replica's lanes running passes side by side
        (``Prefiller.advance(alone=False)``): those run at the same time, each over its own
        rows, reading the same weights.

        ``past[i]``, when given and not None, is the KV of the positions before ``prompts[i]``
        (``[layers, 2, kv_heads, P_i, head_dim]``: a cached prefix, earlier chunks): row ``i``
        is computed at positions ``P_i..`` and attends to those too.

        Returns logits at each row's last token [B, V] (float32) and, per row, the KV of its
        tokens only ``[layers, 2, kv_heads, len_i, head_dim]`` (contiguous, KV dtype, on
        ``kv_device``). Right padding needs no mask of its own: under the causal mask a real
        token never sees the pads that follow it.

        ``into`` (one row, on one device, where :meth:`room_for_chunks`): the row's whole
        prompt's KV in the runner's dtype, ``past[0]`` its first positions; the chunk's KV is
        written into it after them (``PrefillCollector``) and returned as a view of it.
        """
        lens = [len(p) for p in prompts]
        bsz, seq = len(prompts), max(lens)
        ids = torch.zeros((bsz, seq), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(self.device)
        has_past = past is not None and any(p is not None for p in past)
        starts = [0 if not has_past or p is None else p.shape[3] for p in (past or [None] * bsz)]
        positions = (torch.tensor(starts)[:, None] + torch.arange(seq)[None, :]).to(self.device)
        mask, collector = None, PrefillCollector(len(self.layers), into=into, start=starts[0])
        if has_past:
            mask = past_mask(starts, seq).to(self.device)
            if into is None:
                collector.past = padded_past(past, starts, self.layout, self.dtype,
                                             self.kv_device, self.layer_devices)
            else:
                assert bsz == 1 and self.room_for_chunks(into.dtype, into.device)
        hidden = self.embed_tokens(ids)  # [B, S, H]
        span = ({"prefill_span": PrefillSpan.build(starts, self.prefill_bf16)}
                if self.prefill_kernel else {})
        hidden = yield from self._layers(hidden, positions, mask, collector, **span)
        last = torch.tensor(lens, device=hidden.device) - 1
        logits = self._logits(hidden[torch.arange(bsz, device=hidden.device), last])
        return logits, collector.row_kvs(lens, self.layout, self.kv_dtype, self.kv_device)

    def room_for_chunks(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a prompt's KV so far, held in ``dtype`` on ``device``, can take its next
        chunk's KV in place (``prefill_layers``' ``into``): the runner's dtype, one device."""
        return dtype == self.dtype and not self.multi_device and device == self.kv_device

    # ---- decode -------------------------------------------------------------------------

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """The decode pool: ``num_blocks`` blocks of ``block_size`` tokens per layer, in
        ``pool_dtype`` (a package is cast once when it joins, never on every step)."""
        return PagedKVCache(self.layout, self.spans, num_blocks, block_size, self.pool_dtype)

    @torch.inference_mode()
    def decode(self, cache: PagedKVCache, tables: list[list[int]], token_ids: list[int],
               positions: list[int]) -> torch.Tensor:
        """One decode step: row i feeds ``token_ids[i]`` at ``positions[i]`` (its KV length so
        far) of the sequence whose block table is ``tables[i]``; the new key/value is written
        there. Returns logits [B, V] float32."""
        bsz = len(token_ids)
        assert 0 < bsz and len(positions) == bsz == len(tables)
        for table, pos in zip(tables, positions, strict=True):
            assert pos < len(table) * cache.block_size, f"position {pos} has no block"
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device).unsqueeze(1)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device).unsqueeze(1)
        step = PagedDecodeStep.build(cache, tables, positions, inplace=self.inplace_attention)
        with self.lock:
            hidden = self.embed_tokens(ids)  # [B, 1, H]
            if self.fused is not None:
                cos, sin = self.fused.rotary(hidden, pos)  # [B, head_dim] each
                return self.fused(hidden[:, 0], cos, sin, cache, step)
            hidden = self._layers_forward(hidden, pos, None, PagedCacheView(cache, step),
                                          paged_step=step)
            return self._logits(hidden[:, -1])

    @torch.inference_mode()
    def forward_mixed(self, cache: PagedKVCache, tables: list[list[int]], token_ids: list[int],
                      positions: list[int], chunks: list[list[int]],
                      past: list[torch.Tensor | None] | None = None,
                      into: list[torch.Tensor | None] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """A decode step and prompt chunks in one forward pass.

        The decode rows are those of :meth:`decode` (``tables``, ``token_ids``,
        ``positions``; none is allowed), the chunks and ``past`` those of
        :meth:`forward_prefill`. All tokens go through the model as one ``[1, T]`` sequence
        (decode rows first, then each chunk), so each linear layer runs once over every
        token; only attention is per group (``app.attention.MixedStep``).

        ``into[i]`` (a chunk of a prompt of several): the prompt's KV, ``[layers, 2,
        kv_heads, N, head_dim]`` in the runner's dtype, its first ``past[i].shape[3]``
        positions filled (``past[i]``, their view, maybe empty) and room for the chunk: the
        chunk's keys/values are written there and it attends over a view of it (no past +
        chunk concatenation a layer, no copy of the chunk afterwards). With the fused layers,
        a chunk with neither gets a buffer of its own (``FusedLayers.own_buffers``).

        Returns the decode rows' logits [B, V], each chunk's logits at its last token
        [C, V] (float32) and each chunk's KV ``[layers, 2, kv_heads, len_i, head_dim]``
        (contiguous, KV dtype, on ``kv_device``; with ``into[i]``, the view of it that holds
        the chunk's), as :meth:`forward_prefill` returns them.
        """
        bsz = len(token_ids)
        assert len(positions) == bsz == len(tables) and chunks and all(chunks)
        for table, pos in zip(tables, positions, strict=True):
            assert pos < len(table) * cache.block_size, f"position {pos} has no block"
        lens = [len(c) for c in chunks]
        past, into = list(past or [None] * len(chunks)), list(into or [None] * len(chunks))
        owned = (self.fused_layers.own_buffers(lens, past, into)  # one call (pass_call)
                 if self.fused_layers and self.prefill_kernel and self.inplace_attention else ())
        assert all(w is None or (p is not None and w.dtype == self.dtype)
                   for p, w in zip(past, into, strict=True))
        starts = [0 if p is None else p.shape[3] for p in past]
        ids = list(token_ids) + [t for c in chunks for t in c]
        pos = list(positions) + [s + i for s, n in zip(starts, lens, strict=True)
                                 for i in range(n)]
        ids_t = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, T]
        pos_t = torch.tensor([pos], dtype=torch.long, device=self.device)
        step = MixedStep.build(cache, tables, positions, lens, starts,
                               prefill_kernel=self.prefill_kernel,
                               prefill_bf16=self.prefill_bf16, inplace=self.inplace_attention)
        # each chunk's past per layer, in the model's dtype on the layer's device
        layer_past = [
            None if kv is None or w is not None else [
                (kv[li, 0][None].to(dev, self.dtype), kv[li, 1][None].to(dev, self.dtype))
                for li, dev in enumerate(self.layer_devices)]
            for kv, w in zip(past, into, strict=True)]
        view = MixedCacheView(cache, step, layer_past, into)
        ends = torch.tensor(lens).cumsum(0) + bsz - 1
        rows = torch.cat([torch.arange(bsz), ends])
        with self.lock:
            hidden = self.embed_tokens(ids_t)  # [1, T, H]
            hidden = self._layers_forward(hidden, pos_t, None, view, mixed_step=step)
            logits = self._logits(hidden[0, rows.to(hidden.device)])  # [B + C, V]
            kvs = view.chunk_kvs(self.layout, self.kv_dtype, self.kv_device)
        kvs = [kv.to(self.kv_dtype) if i in owned else kv for i, kv in enumerate(kvs)]
        return logits[:bsz], logits[bsz:], kvs
