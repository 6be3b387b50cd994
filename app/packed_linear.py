"""Linear layers with their weights copied once into a layout made for the kernel that
multiplies them (CPU; float32 activations).

What the copy holds is decided in one place, :func:`weight_plan`: float32, bf16 (half the
bytes; on a CPU with AVX512-BF16 in pairs for its bf16 dot product, which also does twice
the multiply-adds per instruction) or int8 with a scale per output channel (a quarter; on a
CPU with AVX512-VNNI in pairs for its 16-bit integer dot product).

A decode step is a few hundred small matrix products (7 per layer plus the LM head) over a
handful of rows, and the weights come from memory every step. Two layouts:

- ``panels`` (the default where it builds: x86-64 with AVX2 and FMA and a C compiler): the
  engine's own kernel, ``app/csrc/panel_gemm.c`` via ``app.cpu_kernels``, over the weight
  copied into strips of 16 output columns. It reads the weights once per product whatever
  the rows, and beats MKL and oneDNN at one row and at a batch's (BENCHMARKS.md §1,
  "The fused decode step and the kernels behind it"; ``load_tests/decode_bench.py`` reports
  the step). Every row is computed alone, one running sum per output, so a row's result is
  bit for bit the same in any batch.
- ``onednn``: oneDNN's linear over the weight reordered into its blocked layout (what
  Inductor's weight freezing does on the CPU), for products of 2+ rows; one-row products keep
  MKL's GEMV over the plain weight (bit for bit the plain model's).

Either way the copy doubles the linear weights' memory (the model's own ``weight`` stays, for
state dicts, fingerprints and tied embeddings); ``engine.kernels.linear: torch`` turns it
off. Sums run in a different order than MKL's, so logits differ from the plain model's in the
last bits; the greedy tokens of the test prompts are the same
(``tests/unit/app/test_packed_linear.py``). A copy is made once at load: a weight changed
afterwards is not seen.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from app.config import LINEAR_LAYOUTS as LAYOUTS
from app.config import EngineConfig, dtype_name, weight_group
from app.cpu_kernels import check, kernel_unavailable, load_kernel, wtype_code
from app.quantized_checkpoint import CHECKPOINT_INT8, dequantize

# Rows the blocked layout is tuned for. 8 served 1 to 256 rows as well as or better than
# 1, 32 or 256 did on this project's CPU (a 2-core AMD EPYC, AVX2).
BATCH_HINT = 8


def weight_plan(config: EngineConfig, int8_checkpoint: bool = False,
                int8_group: int = 0) -> tuple[torch.dtype, str | None, str]:
    """How a CPU engine holds and computes its linear weights: (the dtype the model computes
    in, what its panels hold or None to leave packing to ``kernels.linear``, why).

    float32: float32 panels (or oneDNN's layout). bfloat16 (or weights: int8): the model
    computes in float32 and its linears' panels hold bf16 (``bfloat16dp``: in pairs for the
    CPU's bf16 dot product where it has one, the inputs rounded to bf16 as they enter a
    product; ``bfloat16``: widened to float32 in registers) or int8 (``int8dp``: in pairs for
    the CPU's 16-bit integer dot product where it has AVX512-VNNI, the inputs entering as
    16-bit integers per block of 256; ``int8``: widened); where the panel kernel is not to be
    had, bfloat16 runs through torch's modules in bf16, and int8 raises ``ValueError``.
    ``int8_checkpoint`` (the checkpoint holds int8 weights, app.quantized_checkpoint): int8
    panels as with weights: int8, or without the kernel its weights dequantized. A scale per
    group of k (weights: int8-g<N>, or ``int8_group``, a checkpoint's) needs ``int8dp``:
    without AVX512-VNNI the weights are served in bf16 panels instead (dequantized, for a
    checkpoint), which the reason says."""
    dtype = config.torch_dtype
    if config.device != "cpu":
        return dtype, None, "not on the CPU"
    want = "int8" if config.weights is not None or int8_checkpoint else dtype_name(dtype)
    if want == "float32":
        return dtype, None, "float32"
    layout = config.kernels.linear
    reason = (None if layout != "torch" else "kernels.linear is torch") or (
        None if layout != "onednn" else "kernels.linear onednn is float32 only"
    ) or kernel_unavailable(config.resolved_cache_dir)
    if reason is not None:
        if want == "int8" and config.weights is not None:
            raise ValueError(f"weights: {config.weights} needs the engine's panel kernel: "
                             f"{reason}")
        if want == "int8":
            return dtype, None, (f"the checkpoint's int8 weights dequantized to "
                                 f"{dtype_name(dtype)}, torch's modules: {reason}")
        return dtype, None, f"{want} through torch's modules: {reason}"
    lib = load_kernel(config.resolved_cache_dir)
    if want == "bfloat16" and lib.panel_has_avx512bf16():
        return torch.float32, "bfloat16dp", "bf16 panels, the CPU's bf16 dot product"
    group = int8_group or weight_group(config.weights)
    own = "the GGUF file's own blocks in " if config.weights == "gguf" else ""
    if want == "int8" and lib.panel_has_avx512vnni():
        return (torch.float32, "int8dp", f"{own}int8 panels, one scale per output"
                f"{f' for each {group} of k' if group else ''}, the CPU's 16-bit integer dot "
                f"product (inputs as 16-bit integers per block of {group or 256})")
    if want == "int8" and group:
        bf16 = "bfloat16dp" if lib.panel_has_avx512bf16() else "bfloat16"
        return (torch.float32, bf16, f"bf16 panels ({bf16}) instead of int8 with a scale per "
                f"{group} of k, which needs AVX512-VNNI: the weights in twice the bytes")
    how = "widened to float32 in registers" if want == "bfloat16" else "one scale per output"
    return torch.float32, want, f"{want} panels, {how}"


def packing_unavailable(model: nn.Module, layout: str = "auto",
                        cache_dir: Path | None = None) -> str | None:
    """Why ``model``'s linears cannot be packed in ``layout``, or None when they can
    (``auto``: when either layout can)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "onednn" and not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    params = list(model.parameters())
    if any(p.device.type != "cpu" for p in params):
        return "the model is not on the CPU"
    if any(p.dtype != torch.float32 for p in params if p.is_floating_point()):
        return "the model is not float32"
    if layout == "panels":
        return kernel_unavailable(cache_dir)
    if layout == "auto" and not torch.backends.mkldnn.is_available():
        return kernel_unavailable(cache_dir)
    return None


def resolve_layout(layout: str, cache_dir: Path | None = None) -> str:
    """``auto`` -> ``panels`` where the kernel builds, else ``onednn``."""
    if layout != "auto":
        return layout
    return "panels" if kernel_unavailable(cache_dir) is None else "onednn"


class PackedLinear(nn.Module):
    """``nn.Linear`` (inference only) with a second copy of its weight in oneDNN's blocked
    layout: one-row inputs use the plain weight, anything larger the reordered one.

    ``weight`` and ``bias`` are the original parameters (state dicts, fingerprints and tied
    embeddings see the model unchanged); the reordered copy is a non-persistent buffer.
    """

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer(
            "packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                              batch_hint),
            persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features:  # one row: MKL's GEMV over the plain weight
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias,
                                                  "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, layout=onednn")


def quantize_int8(weight: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8 with one scale per output channel (row), or with ``group``, one per
    row for each ``group`` of k (the last group may be short): symmetric, round to nearest,
    ``weight ~= q * scale`` (each scale over its row's group) with q in [-127, 127]. Returns
    (q int8 [n, k], scale float32 [n], or [n, ceil(k / group)] with a group)."""
    w = weight.detach().float()
    if group:
        n, k = w.shape
        blocks = F.pad(w, (0, -k % group)).view(n, -1, group)
        scale = blocks.abs().amax(dim=2).clamp(min=1e-12) / 127.0
        q = torch.round(blocks / scale[:, :, None]).clamp(-127, 127).view(n, -1)[:, :k]
        return q.to(torch.int8).contiguous(), scale.contiguous()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def kernel_scales(scale: torch.Tensor, nr: int,
                  offset: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped scales [n, groups] as the kernel reads them, panel by panel: [panels, groups,
    ``nr``], the last panel's columns past n zero; with offsets [panels, groups, 2, ``nr``],
    a group's scales and then its offsets, in their dtype (float32, or float16 as a GGUF
    file's: linear_i8dp)."""
    def by_panel(t: torch.Tensor) -> torch.Tensor:
        n, groups = t.shape
        padded = torch.zeros(-(-n // nr) * nr, groups, dtype=t.dtype)
        padded[:n] = t
        return padded.view(-1, nr, groups).transpose(1, 2)

    if offset is None:
        return by_panel(scale).contiguous()
    return torch.stack([by_panel(scale), by_panel(offset)], dim=2).contiguous()


def _int8_weight(linear: nn.Linear, group: int) -> tuple[torch.Tensor, ...]:
    """A linear's int8 weight, scales and offsets (None where it has none): a checkpoint's
    own (``CHECKPOINT_INT8``), else :func:`quantize_int8`'s."""
    own = getattr(linear, CHECKPOINT_INT8, None)
    q, scale, offset = (*own, None)[:3] if own else (*quantize_int8(linear.weight, group), None)
    n, k = linear.out_features, linear.in_features
    shape = (n, -(-k // group)) if group else (n,)
    if tuple(scale.shape) != shape or (offset is not None and tuple(offset.shape) != shape):
        raise ValueError(f"int8 scales {tuple(scale.shape)} do not fit weights [{n}, {k}] "
                         f"with a scale per {group or k} of k")
    return q, scale, offset


class PanelLinear(nn.Module):
    """``nn.Linear`` (inference only) over a copy of its weight in panels, multiplied by the
    engine's own kernel (``app.cpu_kernels``) on ``torch.get_num_threads()`` threads.

    ``weights`` is what the panels hold: ``float32`` (the weight as it is), ``bfloat16`` (half
    the bytes: the weight rounded to bf16) or ``int8`` (a quarter: :func:`quantize_int8`, one
    scale per output); ``bfloat16dp`` and ``int8dp`` hold the same in pairs of k for the
    CPU's dot products (their inputs enter as bf16 / as 16-bit integers scaled per block of
    256). ``group`` (``int8dp`` only): a scale per output for each ``group`` of k (and an
    offset, where a checkpoint's weights have them: app.gguf_blocks). Outputs are float32 in
    every kind.

    ``weight`` is the model's parameter for ``float32``, and, to hold no float32 copy, the
    rounded weight for the others (``bfloat16``; ``int8``: the int8 weight, its scales in
    ``weight_scale``), except where ``keep_weight`` (a weight the model shares with another
    module: tied embeddings). The panels are a non-persistent buffer. Under autograd (grad
    enabled and a tensor that wants one), for an input that is not float32 on the CPU, or
    once moved off the CPU, it falls back to ``F.linear`` over the (dequantized) weight.
    """

    def __init__(self, linear: nn.Linear, cache_dir: Path | None = None,
                 weights: str = "float32", keep_weight: bool = False, group: int = 0) -> None:
        super().__init__()
        wtype_code(weights, group)  # raises ValueError for a kind it lacks
        self._lib = load_kernel(cache_dir)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weights = weights
        self.group = group
        self.bias = linear.bias
        n, k = self.out_features, self.in_features
        count = self._lib.panel_floats(n, k)
        scale = offset = None
        if weights == "float32":
            w = linear.weight.detach().float().contiguous()
            panels = torch.empty(count, dtype=torch.float32)
            self._lib.panel_pack(w.data_ptr(), w.stride(0), n, k, panels.data_ptr())
            self.weight = linear.weight
        else:
            if weights in ("int8", "int8dp"):  # a checkpoint's own, else quantized here
                w, scale, offset = _int8_weight(linear, group)
            else:
                w = linear.weight.detach().to(torch.bfloat16).contiguous()
            if weights in ("bfloat16dp", "int8dp"):  # pairs of k, for the dot products
                panels = torch.empty(self._lib.panel_pair_elems(n, k), dtype=w.dtype)
                pack = (self._lib.panel_pack_pairs if weights == "bfloat16dp"
                        else self._lib.panel_pack_pairs_i8)
                pack(w.data_ptr(), w.stride(0), n, k, panels.data_ptr())
            else:
                panels = torch.empty(count, dtype=w.dtype)
                check(self._lib.panel_pack_bytes(w.data_ptr(), w.stride(0), n, k,
                                                 panels.data_ptr(), w.element_size()),
                      "panel_pack_bytes")
            if keep_weight:
                self.weight = linear.weight
            elif w.dtype == torch.bfloat16:
                self.weight = nn.Parameter(w, requires_grad=False)
            else:
                self.register_buffer("weight", w)
        self.register_buffer("panels", panels, persistent=False)
        self.register_buffer("weight_scale", scale)  # int8's column scales, else None
        self.register_buffer("weight_offset", offset)  # grouped int8's offsets, if any
        self.wtype = wtype_code(weights, group, offset is not None,
                                bool(group) and scale.dtype == torch.float16)
        # what the kernel reads: the column scales, grouped ones panel by panel
        self.register_buffer("kernel_scale", kernel_scales(scale, self._lib.panel_nr(), offset)
                             if group else scale, persistent=False)
        self._bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def plain_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a ``dtype`` matrix (an int8 one dequantized)."""
        if self.weight.dtype == torch.int8:
            assert self.weight_scale is not None
            return dequantize(self.weight, self.weight_scale, self.group,
                              self.weight_offset).to(dtype)
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype != torch.float32 or x.device.type != "cpu"
                or self.panels.device.type != "cpu"
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.plain_weight(x.dtype), bias)  # what the kernel is not for
        k, n = self.in_features, self.out_features
        rows = x.reshape(-1, k)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        m = rows.shape[0]
        out = torch.empty((m, n), dtype=torch.float32)
        if m:
            rc = self._lib.panel_linear_w(
                rows.data_ptr(), m, k, self.panels.data_ptr(), self.wtype,
                None if self.kernel_scale is None else self.kernel_scale.data_ptr(), n,
                None if self._bias is None else self._bias.data_ptr(), out.data_ptr(),
                torch.get_num_threads())
            check(rc, "panel_linear_w")
        return out.view(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        group = f", group={self.group}" if self.group else ""
        group += ", offsets" if self.weight_offset is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, layout=panels, weights={self.weights}{group}")


def weight_kind(model: nn.Module) -> str | None:
    """What ``model``'s panel-packed linears hold (``float32``, ``bfloat16``, ``int8``, ...;
    ``int8dp-g32``: int8 pairs with a scale per 32 of k, ``int8dp-g32-offsets`` and an
    offset), or None when it has none."""
    kinds = {m.weights + (f"-g{m.group}" if m.group else "")
             + ("-offsets" if m.weight_offset is not None else "")
             for m in model.modules() if isinstance(m, PanelLinear)}
    assert len(kinds) <= 1, f"mixed panel kinds {kinds}"
    return next(iter(kinds), None)


def _offsets_for_all(linears: list[nn.Linear], group: int) -> None:
    """Where some linears' int8 weights have offsets (a checkpoint's zero points, a GGUF's
    Q4_1 blocks), every other linear's get zero offsets: one kind of panel, so the fused
    kernels take the model whole."""
    if not any(len(getattr(m, CHECKPOINT_INT8, ())) == 3 for m in linears):
        return
    for m in linears:
        own = getattr(m, CHECKPOINT_INT8, None) or quantize_int8(m.weight, group)
        if len(own) == 2:
            setattr(m, CHECKPOINT_INT8, (*own, torch.zeros_like(own[1])))


def pack_linears(model: nn.Module, batch_hint: int = BATCH_HINT, layout: str = "auto",
                 cache_dir: Path | None = None, weights: str = "float32",
                 group: int = 0) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a :class:`PanelLinear` (``panels``, its
    panels holding ``weights``, int8dp's with a scale per ``group`` of k if one is given) or
    a :class:`PackedLinear` (``onednn``, float32 only; ``auto``: panels where the kernel
    builds); the count.

    Raises ``ValueError`` when packing is not possible (``packing_unavailable``).
    """
    reason = packing_unavailable(model, layout, cache_dir)
    if reason is not None:
        raise ValueError(f"cannot pack linear weights: {reason}")
    layout = resolve_layout(layout, cache_dir)
    if layout != "panels" and weights != "float32":
        raise ValueError(f"{weights} weights need the panels layout, not {layout}")
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is nn.Linear]
    if weights == "int8dp" and group:
        _offsets_for_all([module for _, module in targets], group)
    # weights another module uses too (tied embeddings) stay as they are
    shared = {id(p) for m in model.modules() if type(m) is not nn.Linear
              for p in m.parameters(recurse=False)}
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        packed = (PanelLinear(module, cache_dir, weights, id(module.weight) in shared, group)
                  if layout == "panels" else PackedLinear(module, batch_hint))
        setattr(parent, child, packed)
    return len(targets)
