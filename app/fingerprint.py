"""What identifies a loaded model: its architecture, shapes, the dtype it computes in with
what its panels hold, and a digest of its weights. Two engines exchange KV only when these
are equal (a split's prefill and decode replicas)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from app.config import dtype_name
from app.packed_linear import weight_kind


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Identifies a loaded model: two engines exchange KV only when these are equal."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str
    weights_digest: str

    def as_str(self) -> str:
        return (
            f"{self.architecture}/L{self.num_layers}/kvh{self.num_kv_heads}/hd{self.head_dim}"
            f"/v{self.vocab_size}/{self.dtype}/{self.weights_digest}"
        )


def weights_digest(model: torch.nn.Module, sample: int = 4096) -> str:
    """A digest over every parameter's name, shape and a strided sample of its values.

    Hashing all weights would take time in proportion to the model's bytes; a strided sample
    of each tensor (plus exact shapes) tells apart checkpoints, fine-tunes and dtypes at a
    fraction of that.
    """
    h = hashlib.sha256()
    for name, param in model.state_dict().items():
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // sample)
        picked = flat[::step][:sample].to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(str(tuple(param.shape)).encode())
        h.update(picked.numpy().tobytes())
    return h.hexdigest()[:16]


def model_dtype(model: torch.nn.Module) -> str:
    """The dtype ``model`` computes in, and what its panels hold where that differs
    (``float32+int8``: float32 activations over int8 weights)."""
    name = dtype_name(model.get_input_embeddings().weight.dtype)
    kind = weight_kind(model)
    return name if kind in (None, name) else f"{name}+{kind}"


def fingerprint(model: torch.nn.Module) -> ModelFingerprint:
    cfg = model.config
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return ModelFingerprint(
        architecture=type(model).__name__,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        dtype=model_dtype(model),
        weights_digest=weights_digest(model),
    )
