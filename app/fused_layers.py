"""The layers of prefill and mixed passes in the engine's C kernels (``app/csrc/prefill_layer.c``).

A pass over hundreds of tokens spends most of its time in the products, but through the
model's modules a Llama-style layer also runs a dozen elementwise torch operations (RMSNorm,
rotary embedding, SiLU times up, the residual sums), each a trip through memory, and q/k/v
and gate/up as separate products: a sixth of a 1,024-token prefill of SmolLM2 (BENCHMARKS.md
§1, "Prefill passes"). :class:`FusedLayers` runs each layer as two kernel calls around its
attention: ``layer_qkv`` (RMSNorm, one q/k/v product, rotary embedding) and ``layer_mlp``
(the output product and residual, RMSNorm, one gate/up product, SiLU times up, down and
residual). The attention between them is the runner's own: the same cache view
(``PrefillCollector``, ``MixedCacheView``) and the same registered attention function
(``app.attention.paged_attention``: the prefill kernel, a mixed pass's groups, or SDPA), so
what a pass attends to and what KV it returns do not change.

It serves the models the fused decode step serves (``app.fused_decode``:
``fused_layers_unavailable``) and shares its weight tables (the q/k/v and gate/up panels
side by side); the runner uses it for every pass its modules would run (prefill, mixed,
and decode steps that cannot be fused) on float32 activations on the CPU. The arithmetic is
the decode step's, row by row, so a row's values do not depend on the rest of the pass.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from app.attention import paged_attention
from app.cpu_kernels import WTYPES, assert_kernel_tensors, check, load_kernel

# the per-layer table's entries (app.fused_decode.layer_weights, decode_step.c's order)
(IN_NORM, QKV, QKV_BIAS, OUT, O_BIAS, POST_NORM, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS,
 QKV_SCALE, O_SCALE, GATE_UP_SCALE, DOWN_SCALE) = range(14)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedLayers:
    """A Llama-style model's layers as two kernel calls each (see the module's doc)."""

    def __init__(self, model: torch.nn.Module, weights: list[list[torch.Tensor | None]]) -> None:
        self._lib = load_kernel()
        cfg = model.config
        self.attn = [layer.self_attn for layer in model.model.layers]
        attn = self.attn[0]
        self.hidden = cfg.hidden_size
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.inter = cfg.intermediate_size
        self.eps = float(model.model.norm.variance_epsilon)
        self.wtype = WTYPES[model.lm_head.weights]
        self.weights = weights
        assert len(weights) == len(self.attn)
        self._buffers = threading.local()  # each thread's, see _buffer

    def _buffer(self, name: str, shape: tuple[int, int]) -> torch.Tensor:
        """A float32 ``shape`` tensor for the layer's own use (its normalized rows, q/k/v,
        the MLP's scratch), the calling thread's, reused by every layer of its passes and
        held at its largest pass's size (the scratch: rows x (hidden + 3 x intermediate)
        floats, 5.4 MB for a 259-row pass of SmolLM2). A fresh one would be fresh memory at
        every layer, a page fault per 4 KB at its first write."""
        n = shape[0] * shape[1]
        buf = getattr(self._buffers, name, None)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=torch.float32)
            setattr(self._buffers, name, buf)
        return buf[:n].view(shape)

    def serves(self, hidden: torch.Tensor) -> bool:
        """A pass these kernels compute: float32 activations on the CPU."""
        return hidden.dtype == torch.float32 and hidden.device.type == "cpu"

    @staticmethod
    def rotary(cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's ``(cos, sin)`` [B, S, head_dim] as the kernel reads them: one
        contiguous float32 row per token (made once a pass)."""
        cos, sin = cos_sin
        return (cos.reshape(-1, cos.shape[-1]).float().contiguous(),
                sin.reshape(-1, sin.shape[-1]).float().contiguous())

    def layer(self, index: int, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
              mask: torch.Tensor | None, cache: Any, **attention_kwargs: Any) -> torch.Tensor:
        """Layer ``index`` over ``hidden`` [B, S, H] (float32; updated in place when
        contiguous) -> the layer's output [B, S, H]. ``rotary``: :meth:`rotary`'s rows."""
        bsz, seq, h = hidden.shape
        m = bsz * seq
        nq, nkv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        x = hidden.contiguous()
        cos, sin = rotary
        assert_kernel_tensors(hidden=(x, torch.float32), cos=(cos, torch.float32),
                              sin=(sin, torch.float32))
        assert h == self.hidden and cos.shape == sin.shape == (m, self.head_dim)
        w = self.weights[index]
        xn = self._buffer("xn", (m, h))
        # q, k and v are read within the layer only: the cache view copies what it keeps
        qkv = self._buffer("qkv", (m, nq + 2 * nkv))
        threads = torch.get_num_threads()
        check(self._lib.layer_qkv(
            x.data_ptr(), m, h, w[IN_NORM].data_ptr(), self.eps, w[QKV].data_ptr(), self.wtype,
            _ptr(w[QKV_SCALE]), _ptr(w[QKV_BIAS]), self.heads, self.kv_heads, self.head_dim,
            cos.data_ptr(), sin.data_ptr(), xn.data_ptr(), qkv.data_ptr(), threads), "layer_qkv")
        hd = self.head_dim
        q = qkv[:, :nq].view(bsz, seq, self.heads, hd).transpose(1, 2)
        # keys and values copied out where the cache view keeps them (for the pass's KV): what
        # it keeps is theirs, not the whole product's rows; else they are copied at once
        kv = qkv[:, nq:].clone() if getattr(cache, "keeps_kv", True) else qkv[:, nq:]
        k = kv[:, :nkv].view(bsz, seq, self.kv_heads, hd).transpose(1, 2)
        v = kv[:, nkv:].view(bsz, seq, self.kv_heads, hd).transpose(1, 2)
        attn = self.attn[index]
        k, v = cache.update(k, v, attn.layer_idx)
        window = ({"sliding_window": attn.sliding_window} if hasattr(attn, "sliding_window")
                  else {})
        out, _ = paged_attention(attn, q, k, v, mask, scaling=attn.scaling, dropout=0.0,
                                 **window, **attention_kwargs)
        att = out.reshape(m, nq).float().contiguous()  # [B, S, heads, hd] -> rows
        scratch = self._buffer("scratch", (m, h + 3 * self.inter))
        check(self._lib.layer_mlp(
            x.data_ptr(), m, h, att.data_ptr(), nq, w[OUT].data_ptr(), _ptr(w[O_SCALE]),
            _ptr(w[O_BIAS]), w[POST_NORM].data_ptr(), self.eps, w[GATE_UP].data_ptr(),
            _ptr(w[GATE_UP_SCALE]), _ptr(w[GATE_UP_BIAS]), self.inter, w[DOWN].data_ptr(),
            _ptr(w[DOWN_SCALE]), _ptr(w[DOWN_BIAS]), self.wtype, scratch.data_ptr(), threads),
            "layer_mlp")
        return x.view(bsz, seq, h)
