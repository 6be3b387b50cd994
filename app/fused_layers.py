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

Where every chunk of a pass is written into its prompt's KV (``into``: a chunked prompt's,
or a buffer of its own for a prompt without a past), the layers run through one call each
(``mixed_layers``; a mixed pass's all in one: :meth:`FusedLayers.pass_call`): the same
kernels in the same order as the layer loop, so the same bits, without the loop's Python
between them (about 0.6 ms a layer of SmolLM2, while the OpenMP team waits: W-long in one
process 1.17x prompt tok/s, docs/benchmarks/results/2026-12-07-mixed-one-call/).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Generator
from typing import Any

import torch

from app.attention import MixedCacheView, paged_attention
from app.cpu_kernels import assert_kernel_tensors, check, load_kernel
from app.fused_decode import PointerTables
from app.prefill_inputs import PrefillCollector

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
        self.wtype = model.lm_head.wtype
        self.weights = weights
        assert len(weights) == len(self.attn)
        self._buffers = threading.local()  # each thread's, see _buffer
        # passes in one call a layer (pass_call): every layer's attention the same, unwindowed
        scales = {a.scaling for a in self.attn}
        self.one_scale = (scales.pop() if len(scales) == 1 and None not in scales
                          and all(getattr(a, "sliding_window", None) is None for a in self.attn)
                          else None)
        self._tables = PointerTables(weights)  # mixed_layers' pointer tables

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

    def own_buffers(self, lens: list[int], past: list, into: list) -> set[int]:
        """For a mixed pass's chunks without a past or a buffer (a prompt's first chunk, a
        short prompt whole): a buffer of their own length for ``into`` (``past`` an empty
        view of it), so that the pass is one call (:meth:`pass_call`); the chunks given
        one. Their KV comes back as the buffer (float32): the caller casts it to the KV
        dtype, as the layer loop's copies do."""
        owned = {i for i, (p, w) in enumerate(zip(past, into, strict=True))
                 if p is None and w is None}
        for i in owned:
            into[i] = self._own_buffer(lens[i])
            past[i] = into[i][:, :, :, :0]
        return owned

    def _own_buffer(self, n: int) -> torch.Tensor:
        """A KV buffer for ``n`` positions, as ``mixed_layers`` writes it: float32 [layers,
        2, kv_heads, n, head_dim]."""
        return torch.empty((len(self.attn), 2, self.kv_heads, n, self.head_dim))

    def _takes(self, kv: torch.Tensor | None) -> bool:
        """A prompt's KV buffer laid out as ``mixed_layers`` reads it."""
        return (kv is not None and kv.dtype == torch.float32 and kv.device.type == "cpu"
                and kv.is_contiguous() and kv.shape[:3] == (len(self.attn), 2, self.kv_heads)
                and kv.shape[4] == self.head_dim)

    def _chunks(self, seq: int, cache: Any, attention_kwargs: dict):
        """What ``mixed_layers`` computes the pass as, where it computes it as :meth:`layer`
        would: ``(mixed step or None, [(length, past, buffer)], bf16 attention)``. A mixed
        pass whose chunks all have ``into`` and attend through the prefill kernel, its
        decode rows reading and writing the pool in place; a prefill pass (the prefill
        kernel's ``PrefillSpan``) of one row with ``into`` or of rows with no past (each
        given a buffer of its own, ``PrefillCollector.owned``). Else None."""
        kwargs = set(attention_kwargs)
        if self.one_scale is None:
            return None
        if isinstance(cache, MixedCacheView) and kwargs == {"mixed_step"}:
            step = cache.step
            if (not step.prefill_kernel or not all(map(self._takes, cache.into))
                    or (step.rows and not (step.decode.inplace and step.kv_kernel))):
                return None
            return step, list(zip(step.chunk_lens, step.past_lens, cache.into, strict=True)), \
                step.prefill_bf16
        if not isinstance(cache, PrefillCollector) or kwargs != {"prefill_span"}:
            return None
        bf16 = attention_kwargs["prefill_span"].bf16
        if cache.into is not None:
            return (None, [(seq, cache.start, cache.into)], bf16) if self._takes(cache.into) \
                else None
        if cache.past is not None:
            return None
        rows = len(attention_kwargs["prefill_span"].starts)
        cache.owned = [self._own_buffer(seq) for _ in range(rows)]
        return None, [(seq, 0, kv) for kv in cache.owned], bf16

    def pass_call(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                  cache: Any, attention_kwargs: dict):
        """A function running the pass's layers ``[first, first + n)`` in one kernel call
        (``mixed_layers``, prefill_layer.c: the calls :meth:`layer` and the cache view
        make, in their order, without the Python between them) on ``hidden`` [B, S, H]
        (contiguous float32, updated in place), or None for a pass it does not take
        (:meth:`_chunks`; the caller runs :meth:`layer` for each layer)."""
        bsz, seq, h = hidden.shape
        spec = self._chunks(seq, cache, attention_kwargs) if hidden.is_contiguous() else None
        if spec is None:
            return None
        step, chunks, bf16 = spec
        m, nq, nkv = bsz * seq, self.heads * self.head_dim, self.kv_heads * self.head_dim
        cos, sin = rotary
        assert_kernel_tensors(hidden=(hidden, torch.float32), cos=(cos, torch.float32),
                              sin=(sin, torch.float32))
        assert h == self.hidden and cos.shape == sin.shape == (m, self.head_dim)
        rows, decode = (step.rows, step.decode) if step is not None else (0, None)
        write = read = offsets = None
        if rows:
            (write,), (read,) = decode.write_slots.values(), decode.read_slots.values()
            offsets = decode.offsets
            assert_kernel_tensors(write=(write, torch.long), read=(read, torch.long),
                                  offsets=(offsets, torch.long))
            assert write.numel() == rows and offsets.numel() == rows + 1
        lens, pasts, rooms = (torch.tensor(v, dtype=torch.long) for v in (
            [c[0] for c in chunks], [c[1] for c in chunks], [c[2].shape[3] for c in chunks]))
        into = (ctypes.c_void_p * len(chunks))(*(c[2].data_ptr() for c in chunks))
        pool = cache.layers[0] if rows else None
        args = (h, self.heads, self.kv_heads, self.head_dim, self.inter, cos.data_ptr(),
                sin.data_ptr(), self.eps, float(self.one_scale), rows, _ptr(write), _ptr(read),
                0 if read is None else read.numel(), _ptr(offsets),
                0 if pool is None else pool.shape[1],
                pool is not None and pool.dtype == torch.bfloat16, len(chunks),
                lens.data_ptr(), pasts.data_ptr(), rooms.data_ptr(), into, bf16, self.wtype)
        table = self._tables.get(cache.layers if rows else None)

        def run(first: int, n: int) -> None:
            # the calling thread's buffers (a pass's layers may run on other threads)
            buffers = [self._buffer(name, (m, k)).data_ptr() for name, k in (
                ("xn", h), ("qkv", nq + 2 * nkv), ("att", nq), ("scratch", h + 3 * self.inter))]
            # what the call reads, held until it returns
            keep = (lens, pasts, rooms, cos, sin, write, read, offsets, chunks)  # noqa: F841
            check(self._lib.mixed_layers(hidden.data_ptr(), m, first, n, table, *args,
                                         *buffers, torch.get_num_threads()), "mixed_layers")
        return run

    def run_layers(self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                   mask: torch.Tensor | None, cache: Any, **attention_kwargs: Any
                   ) -> Generator[int, None, torch.Tensor]:
        """Every layer over ``hidden`` (the model's rotary module's ``cos_sin``), yielding
        after each (layers done so far; a mixed pass, run to its end by its caller: once,
        after all), in one kernel call a layer (:meth:`pass_call`) or a mixed pass's all
        where it can, else through :meth:`layer`; returns the last layer's output."""
        rotary = self.rotary(cos_sin)
        hidden = hidden.contiguous()
        run, n = self.pass_call(hidden, rotary, cache, attention_kwargs), len(self.attn)
        if run is not None:
            every = n if "mixed_step" in attention_kwargs else 1
            for first in range(0, n, every):
                run(first, every)
                yield first + every
            return hidden
        for index in range(n):
            hidden = self.layer(index, hidden, rotary, mask, cache, **attention_kwargs)
            yield index + 1
        return hidden
