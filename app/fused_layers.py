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

A mixed pass whose chunks are all written into their prompts' KV (``into``, as every chunk
of a chunked prompt is) runs all its layers in one call (:meth:`FusedLayers.mixed_pass`,
``mixed_layers``): the same kernels in the same order as the layer loop, so the same bits,
without the loop's Python between them (about 0.6 ms a layer of SmolLM2, while the OpenMP
team waits: W-long in one process 1.17x prompt tok/s,
docs/benchmarks/results/2026-12-07-mixed-one-call/).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

from app.attention import MixedCacheView, paged_attention
from app.cpu_kernels import WTYPES, assert_kernel_tensors, check, load_kernel
from app.fused_decode import pointer_table

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
        # a mixed pass in one call (mixed_pass): every layer's attention the same, unwindowed
        scales = {a.scaling for a in self.attn}
        self.one_scale = (scales.pop() if len(scales) == 1 and None not in scales
                          and all(getattr(a, "sliding_window", None) is None for a in self.attn)
                          else None)
        self._table: tuple[Any, ctypes.Array] | None = None  # (the pool, its pointer table)

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

    def _one_call(self, cache: Any, attention_kwargs: dict) -> bool:
        """Whether :meth:`mixed_pass` computes this pass exactly as :meth:`layer` would: a
        mixed pass whose chunks all have ``into`` (float32, contiguous, as the kernel lays
        them out) and attend through the prefill kernel, and whose decode rows read and
        write the pool in place."""
        step = attention_kwargs.get("mixed_step")
        if (not isinstance(cache, MixedCacheView) or set(attention_kwargs) != {"mixed_step"}
                or self.one_scale is None or not step.prefill_kernel
                or (step.rows and not (step.decode.inplace and step.kv_kernel))):
            return False
        shape = (len(self.attn), 2, self.kv_heads)
        return all(t is not None and t.dtype == torch.float32 and t.device.type == "cpu"
                   and t.is_contiguous() and t.shape[:3] == shape
                   and t.shape[4] == self.head_dim for t in cache.into)

    def mixed_pass(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                   cache: Any, attention_kwargs: dict) -> torch.Tensor | None:
        """Every layer of a mixed pass in one kernel call (``mixed_layers``, prefill_layer.c:
        the calls :meth:`layer` and the cache view make, in their order, without the
        Python between them) -> the last layer's output, or None for a pass it does not
        take (:meth:`_one_call`; the caller runs :meth:`layer` for each layer)."""
        if not self._one_call(cache, attention_kwargs):
            return None
        step, pool = cache.step, cache.layers
        bsz, seq, h = hidden.shape
        m, nq, nkv = bsz * seq, self.heads * self.head_dim, self.kv_heads * self.head_dim
        x, (cos, sin) = hidden.contiguous(), rotary
        assert_kernel_tensors(hidden=(x, torch.float32), cos=(cos, torch.float32),
                              sin=(sin, torch.float32))
        assert h == self.hidden and cos.shape == sin.shape == (m, self.head_dim)
        if self._table is None or self._table[0] is not pool:
            self._table = (pool, pointer_table(self.weights, cache))
        write = read = offsets = None
        if step.rows:
            (write,), (read,) = step.decode.write_slots.values(), step.decode.read_slots.values()
            offsets = step.decode.offsets
            assert_kernel_tensors(write=(write, torch.long), read=(read, torch.long),
                                  offsets=(offsets, torch.long))
            assert write.numel() == step.rows and offsets.numel() == step.rows + 1
        into = cache.into
        lens, pasts, rooms = (torch.tensor(v, dtype=torch.long) for v in (
            step.chunk_lens, step.past_lens, [t.shape[3] for t in into]))
        buffers = [self._buffer(name, (m, n)) for name, n in (
            ("xn", h), ("qkv", nq + 2 * nkv), ("att", nq), ("scratch", h + 3 * self.inter))]
        check(self._lib.mixed_layers(
            x.data_ptr(), m, len(self.attn), self._table[1], h, self.heads, self.kv_heads,
            self.head_dim, self.inter, cos.data_ptr(), sin.data_ptr(), self.eps,
            float(self.one_scale), step.rows, _ptr(write), _ptr(read),
            0 if read is None else read.numel(), _ptr(offsets), pool[0].shape[1],
            pool[0].dtype == torch.bfloat16, len(into), lens.data_ptr(), pasts.data_ptr(),
            rooms.data_ptr(), (ctypes.c_void_p * len(into))(*(t.data_ptr() for t in into)),
            step.prefill_bf16, self.wtype, *(b.data_ptr() for b in buffers),
            torch.get_num_threads()), "mixed_layers")
        return x.view(bsz, seq, h)
