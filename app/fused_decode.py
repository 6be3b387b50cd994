"""A decode step's layers in one call to the engine's C kernel (``app/csrc/decode_step.c``).

Through the model's own modules a decode step of SmolLM2-135M is about a thousand torch
operations (30 layers of norms, products, rotary embedding, the KV write, attention, SiLU and
residual adds, most on a few hundred floats), each paying torch's dispatch: on the one core of
the split's decode replica, a large share of a batch-1 step even after the products had their
own kernel (BENCHMARKS.md §1, "The fused decode step and the kernels behind it").
:class:`FusedDecode` runs the whole stack, final norm and LM head included, as one C call
over the same weights (the panels ``app.packed_linear`` made) and the same paged pool, so a
step costs its arithmetic and its memory traffic.

It serves Llama-style decoders (Llama, Mistral, Qwen2: pre-norm RMSNorm layers, rotary
attention with grouped KV heads, a SiLU-gated MLP) whose linears are panel-packed and whose
attention reads the pool in place. :func:`fused_decode_unavailable` says why a model is not
served (the runner then steps through the model's modules, as before). The embedding lookup
stays the model's own, and so do the rotary module's cos/sin: made by the module, for
every position up to the longest seen, once (:class:`RotaryTable`; a step gathers its rows),
or per step where the module's values depend on more than the position (dynamic rope
scaling), so any rope scaling the model implements holds. The q/k/v panels and the gate/up
panels are laid side by side in one buffer each (the separate layers' panels become views of
it: no extra memory), so each pair or triple is one product.

Prefill and mixed passes keep the model's modules: a pass over hundreds of tokens spends its
time in the products, not in dispatch.
"""

from __future__ import annotations

import ctypes

import torch

from app.attention import PagedDecodeStep
from app.cpu_kernels import assert_kernel_tensors, check, load_kernel
from app.kv_cache import PagedKVCache
from app.packed_linear import PanelLinear

# decoder layer classes whose forward is the one decode_step.c computes
LLAMA_STYLE_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})

_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
                ("mlp", "down_proj"))


def _linear(layer, path):
    return getattr(getattr(layer, path[0], None), path[1], None)


def fused_layers_unavailable(model: torch.nn.Module) -> str | None:
    """Why ``model``'s layers cannot run in the engine's fused layer kernels (the decode step
    here, prefill and mixed passes in ``app.fused_layers``), or None when they can."""
    cfg = model.config
    layers = list(model.model.layers)
    names = {type(layer).__name__ for layer in layers}
    if not names <= LLAMA_STYLE_LAYERS:
        return f"layers {sorted(names - LLAMA_STYLE_LAYERS)} are not Llama-style"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {getattr(cfg, 'hidden_act', None)!r} is not silu"
    linears = [_linear(layer, p) for layer in layers for p in _PROJECTIONS]
    linears.append(model.lm_head)
    if not all(type(lin) is PanelLinear for lin in linears):
        return "the linear layers are not panel-packed (kernels.linear)"
    if len({lin.wtype for lin in linears}) != 1:
        return "the linear layers' panels hold different kinds of weight (or int8 groups)"
    if any(lin.panels.device.type != "cpu" for lin in linears):
        return "the model is not on the CPU"
    attn = layers[0].self_attn
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = attn.head_dim
    if heads * head_dim != attn.q_proj.out_features or head_dim % 2:
        return "the attention's shape is not heads x head_dim"
    if any(n % 16 for n in (heads * head_dim, kv_heads * head_dim, cfg.intermediate_size)):
        return "projection widths are not multiples of 16 (the panels cannot lie side by side)"
    norms = [model.model.norm] + [n for layer in layers
                                  for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if len({getattr(n, "variance_epsilon", None) for n in norms}) != 1:
        return "the RMSNorms do not share one epsilon"
    if len({layer.self_attn.scaling for layer in layers}) != 1:
        return "the layers' attention scales differ"
    return None


def fused_decode_unavailable(model: torch.nn.Module, inplace_attention: bool) -> str | None:
    """Why ``model``'s decode steps cannot run as one kernel call, or None when they can."""
    if not inplace_attention:
        return "decode attention does not read the pool in place"
    return fused_layers_unavailable(model)


def _side_by_side(linears: list[PanelLinear]
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One panel buffer for several products over the same input, the products' outputs
    side by side; each layer's ``panels`` becomes a view of it. Their biases likewise (zeros
    for a layer without), or None when none has one; and int8 panels' scales as the kernel
    reads them, side by side likewise (else None)."""
    whole = torch.cat([lin.panels for lin in linears])
    start = 0
    for lin in linears:
        n = lin.panels.numel()
        lin.panels = whole[start : start + n]
        start += n
    scales = None
    if linears[0].kernel_scale is not None:  # [n], or grouped [panels, groups, 16]
        scales = torch.cat([lin.kernel_scale for lin in linears]).contiguous()
    if all(lin._bias is None for lin in linears):
        return whole, None, scales
    bias = torch.cat([lin._bias if lin._bias is not None
                      else torch.zeros(lin.out_features) for lin in linears])
    return whole, bias.float().contiguous(), scales


def layer_weights(model: torch.nn.Module) -> list[list[torch.Tensor | None]]:
    """Per layer, the tensors the fused kernels read, in decode_step.c's order (its enum, up
    to the KV pool): the norms' weights (float32), the q/k/v and gate/up panels side by side
    (the layers' own panels become views of them), the output and down panels, biases and
    int8 scales (None where absent). Built once a model: the decode step and the prefill
    layers share it."""
    tables: list[list[torch.Tensor | None]] = []
    for layer in model.model.layers:
        qkv, qkv_bias, qkv_scale = _side_by_side([layer.self_attn.q_proj,
                                                  layer.self_attn.k_proj,
                                                  layer.self_attn.v_proj])
        gate_up, gate_up_bias, gate_up_scale = _side_by_side([layer.mlp.gate_proj,
                                                              layer.mlp.up_proj])
        o, down = layer.self_attn.o_proj, layer.mlp.down_proj
        tables.append([
            layer.input_layernorm.weight.detach().float().contiguous(), qkv, qkv_bias,
            o.panels, o._bias,
            layer.post_attention_layernorm.weight.detach().float().contiguous(),
            gate_up, gate_up_bias, down.panels, down._bias,
            qkv_scale, o.kernel_scale, gate_up_scale, down.kernel_scale])
    return tables


class RotaryTable:
    """The rotary module's cos/sin, widened to float32 (what ``decode_step.c`` reads), for
    positions 0..n-1, made by the module itself and grown as longer positions come: a
    decode step gathers its rows instead of calling the module and widening what it returns
    (alone 8-9 against 22-25 us; the module's call took 0.08-0.12 ms inside a step, whose
    weights leave the caches cold: BENCHMARKS.md §1).
    The module computes each position's values on their own, so a row is the module's
    answer for that position bit for bit; rope types whose module rescales by the sequence
    length (``dynamic``, ``longrope``) get no table (:meth:`for_module`)."""

    POSITION_ONLY = frozenset({"default", "linear", "llama3", "yarn"})

    def __init__(self, rotary: torch.nn.Module, dtype: torch.dtype) -> None:
        self.rotary, self.dtype = rotary, dtype
        self.cos = self.sin = torch.empty(0)

    @classmethod
    def for_module(cls, rotary: torch.nn.Module, dtype: torch.dtype) -> RotaryTable | None:
        position_only = getattr(rotary, "rope_type", "default") in cls.POSITION_ONLY
        return cls(rotary, dtype) if position_only else None

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, head_dim] float32 at ``positions`` [B] (long)."""
        top = int(positions.max()) + 1
        if top > len(self.cos):
            n = max(top, 2 * len(self.cos), 1024)
            probe = torch.empty(1, 1, 1, dtype=self.dtype)  # the module reads its dtype only
            cos, sin = self.rotary(probe, torch.arange(n).unsqueeze(0))
            self.cos, self.sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


class PointerTables:
    """decode_step.c's per-layer pointer tables (``decode_step``, ``mixed_layers``): each
    layer's ``weights`` (:func:`layer_weights`) and then its pool's keys and values, for the
    last pool asked for and for no pool (NULL: passes without decode rows), each kept for
    the next call. A table points into those tensors: the caller holds them while it runs."""

    def __init__(self, weights: list[list[torch.Tensor | None]]) -> None:
        self.weights = weights
        self._pool: tuple[list[torch.Tensor], ctypes.Array] | None = None
        self._no_pool: ctypes.Array | None = None

    def _build(self, pools: list[torch.Tensor] | None) -> ctypes.Array:
        ptrs: list[int | None] = []
        for index, layer in enumerate(self.weights):
            ptrs += [None if t is None else t.data_ptr() for t in layer]
            if pools is None:
                ptrs += [None, None]
                continue
            pool = pools[index]  # [2, slots, kv_heads, head_dim]
            assert pool.is_contiguous() and pool.dtype in (torch.float32, torch.bfloat16)
            assert pool.shape == pools[0].shape  # one slot count for every layer
            ptrs += [pool[0].data_ptr(), pool[1].data_ptr()]
        return (ctypes.c_void_p * len(ptrs))(*ptrs)

    def get(self, pools: list[torch.Tensor] | None) -> ctypes.Array:
        """The table for ``pools`` (a ``PagedKVCache``'s ``layers``), or for no pool (None);
        safe from several threads (a prefill lane's passes run on their own)."""
        if pools is None:
            if self._no_pool is None:
                self._no_pool = self._build(None)
            return self._no_pool
        held = self._pool
        if held is None or held[0] is not pools:
            held = self._pool = (pools, self._build(pools))
        return held[1]


class FusedDecode:
    """Decode steps of a Llama-style model as one call to ``decode_step.c``."""

    def __init__(self, model: torch.nn.Module,
                 weights: list[list[torch.Tensor | None]] | None = None) -> None:
        self._lib = load_kernel()
        cfg = model.config
        layers = list(model.model.layers)
        attn = layers[0].self_attn
        self.num_layers = len(layers)
        self.hidden = cfg.hidden_size
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.inter = cfg.intermediate_size
        self.eps = float(model.model.norm.variance_epsilon)
        self.scale = float(attn.scaling)
        self.final_norm = model.model.norm.weight.detach().float().contiguous()
        self.lm_head = model.lm_head
        self.vocab = model.lm_head.out_features
        self.weights = self.lm_head.weights
        self.wtype = self.lm_head.wtype
        # per layer, what decode_step.c's pointer table holds, in its order, but the KV pool
        # (its last two); held here: the table points into them
        self._weights = layer_weights(model) if weights is None else weights
        assert self._lib.decode_step_layer_ptrs() == len(self._weights[0]) + 2
        self._tables = PointerTables(self._weights)
        self._rotary = model.model.rotary_emb
        # the module's dtype: the embeddings' (what the step's hidden states come in)
        self._rotary_table = RotaryTable.for_module(
            self._rotary, model.get_input_embeddings().weight.dtype)

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, head_dim] at ``positions`` [B, 1] for the step over ``hidden``
        [B, 1, H] (the embeddings): the table's rows, or the module's answer."""
        if self._rotary_table is not None:
            return self._rotary_table.rows(positions[:, 0])
        cos, sin = self._rotary(hidden, positions)
        return cos[:, 0], sin[:, 0]

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 cache: PagedKVCache, step: PagedDecodeStep) -> torch.Tensor:
        """``hidden`` [B, H] (the embeddings; overwritten), ``cos``/``sin`` [B, head_dim] at
        each row's position -> logits [B, V] float32. Each row's new key and value are
        written into its slot of ``cache``."""
        assert step.inplace and step.offsets is not None
        bsz = hidden.shape[0]
        hidden = hidden.float().contiguous()
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        logits = torch.empty((bsz, self.vocab), dtype=torch.float32)
        (write,), (read,) = step.write_slots.values(), step.read_slots.values()
        assert_kernel_tensors(write=(write, torch.long), read=(read, torch.long),
                              offsets=(step.offsets, torch.long))
        assert write.numel() == bsz and step.offsets.numel() == bsz + 1
        assert cos.shape == sin.shape == (bsz, self.head_dim)
        assert hidden.shape == (bsz, self.hidden)
        slots = cache.layers[0].shape[1]  # [2, slots, kv_heads, head_dim]
        head_bias = self.lm_head._bias
        rc = self._lib.decode_step(
            hidden.data_ptr(), bsz, self.num_layers, self._tables.get(cache.layers), self.hidden,
            self.heads, self.kv_heads, self.head_dim, self.inter, cos.data_ptr(),
            sin.data_ptr(), self.eps, self.scale, write.data_ptr(), read.data_ptr(),
            read.numel(), step.offsets.data_ptr(), slots, self.final_norm.data_ptr(),
            self.lm_head.panels.data_ptr(),
            None if head_bias is None else head_bias.data_ptr(), self.vocab,
            logits.data_ptr(), torch.get_num_threads(), self.wtype,
            None if self.lm_head.kernel_scale is None else self.lm_head.kernel_scale.data_ptr(),
            cache.layers[0].dtype == torch.bfloat16)
        check(rc, "decode_step")
        return logits
