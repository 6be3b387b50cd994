"""Linear layers with their weights reordered once into oneDNN's blocked layout (CPU, float32).

A decode step is a few hundred small matrix products (7 per layer plus the LM head) over
a handful of rows. MKL's sgemm, which ``F.linear`` calls on the CPU, handles a few rows
poorly; oneDNN's linear over a weight reordered ahead of time into its own blocked layout
(what Inductor's weight freezing does on the CPU) does better from 2 rows up: measured on
SmolLM2-135M, one thread, a batch-8 decode step takes 13-22% less time and a 1,024-row
product 23% less. At one row MKL's GEMV is the faster (oneDNN's took 20-35% longer per
step), so :class:`PackedLinear` keeps both: the model's own weight for one-row products
(a lone stream decodes bit for bit as the plain model does) and the reordered copy for the
rest. The cost is a second copy of every linear weight; ``EngineConfig.pack_weights =
False`` turns it off. ``load_tests/decode_bench.py`` reports the step both ways.

The reordered kernel's sums run in a different order, so logits of batched rows differ from
the plain ones in the last bits (about 1e-3 on SmolLM2's logits); the greedy tokens of the
test prompts are the same (``tests/unit/app/test_packed_linear.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows the blocked layout is tuned for. 8 served 1 to 256 rows as well as or better than
# 1, 32 or 256 did on this project's CPU (a 2-core AMD EPYC, AVX2).
BATCH_HINT = 8


def packing_unavailable(model: nn.Module) -> str | None:
    """Why ``model``'s linears cannot be packed, or None when they can."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    params = list(model.parameters())
    if any(p.device.type != "cpu" for p in params):
        return "the model is not on the CPU"
    if any(p.dtype != torch.float32 for p in params if p.is_floating_point()):
        return "the model is not float32"
    return None


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


def pack_linears(model: nn.Module, batch_hint: int = BATCH_HINT) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a :class:`PackedLinear`; the count.

    Raises ``ValueError`` when packing is not possible (``packing_unavailable``).
    """
    reason = packing_unavailable(model)
    if reason is not None:
        raise ValueError(f"cannot pack linear weights: {reason}")
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is nn.Linear]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(module, batch_hint))
    return len(targets)
