"""A GGUF file's own quantized blocks, kept for the int8 panels (``weights: gguf``): the
default model ships as ``Q4_1`` linears and a ``Q8_0`` embedding, 32 weights a block with a
float16 scale (and for ``Q4_1`` a float16 minimum), which int8 panels with a scale and an
offset per 32 of k hold exactly. The engine then serves the weights the file holds, where
``weights: int8`` would quantize their dequantized values a second time.

Block layouts (ggml's, one row of a ``[out, in]`` weight after another, 32 weights a block
along ``in``):

- ``Q8_0``: scale ``d`` (float16), 32 int8 ``q``: ``w = d * q``;
- ``Q4_0``: ``d``, 16 bytes of nibbles (weight j in byte j's low four bits, j + 16 in its
  high four): ``w = d * (nibble - 8)``;
- ``Q4_1``: ``d``, minimum ``m`` (float16), the same nibbles: ``w = d * nibble + m``.

A llama file's q and k rows are stored permuted for its rotary layout; they are put back as
transformers puts back the dequantized ones (whole rows move, each with its blocks). Every
linear's blocks, dequantized, must equal the weight the model loaded from the same file,
or the load fails naming the first that does not.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from app.config import GGUF_GROUP
from app.errors import ModelLoadError
from app.quantized_checkpoint import CHECKPOINT_INT8, dequantize

logger = logging.getLogger(__name__)

GROUP = GGUF_GROUP  # k per block of every type read here
TYPES = ("Q8_0", "Q4_0", "Q4_1")
_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


def _hf_name(name: str) -> str | None:
    """The HF linear a GGUF tensor is (``blk.3.attn_q.weight`` -> model.layers.3.self_attn
    .q_proj; ``output.weight`` -> lm_head), or None for any other tensor."""
    parts = name.split(".")
    if parts == ["output", "weight"]:
        return "lm_head"
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _PROJECTIONS:
        return f"model.layers.{parts[1]}.{_PROJECTIONS[parts[2]]}"
    return None


def decode(kind: str, raw: np.ndarray, rows: int, cols: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One tensor's blocks (``raw``: its bytes, row by row) as int8 [rows, cols], scales
    [rows, cols / 32] and offsets (``Q4_1``; else None), float16 as the file holds them
    (the kernel reads them so: half the bytes of float32's)."""
    width = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // GROUP, width)
    scale = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0])
    offset = None
    if kind == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8))
    else:
        nibbles = blocks[..., width - 16:]
        q = torch.from_numpy(np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1)
                             .astype(np.int8))
        if kind == "Q4_0":
            q = q - 8
        else:
            offset = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
    return q.reshape(rows, cols).contiguous(), scale.contiguous(), offset


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows put back from llama.cpp's rotary permutation (transformers' own reverse)."""
    dim = t.shape[0] // heads // 2
    return t.reshape(heads, dim, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


def attach_gguf_blocks(model: nn.Module, gguf_path: Path) -> int:
    """Each of ``model``'s linears keeps its blocks from ``gguf_path`` in ``CHECKPOINT_INT8``
    (int8, scales [out, in / 32], and for Q4_1 offsets); the count. A tied LM head takes the
    embedding's. Raises ``ModelLoadError`` for a file that is not a llama GGUF, a linear of
    another type than Q8_0, Q4_0 or Q4_1, or blocks that do not give the loaded weight."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"]
    arch = bytes(arch.parts[arch.data[0]]).decode()
    if arch != "llama":
        raise ModelLoadError(f"weights: gguf reads llama GGUF files, {gguf_path.name} is {arch}")
    cfg = model.config
    tensors = {t.name: t for t in reader.tensors}
    tied = getattr(cfg, "tie_word_embeddings", False) and "token_embd.weight" in tensors
    if "output.weight" not in tensors and tied:
        tensors["output.weight"] = tensors["token_embd.weight"]
    modules = dict(model.named_modules())
    kept: dict[str, tuple] = {}
    for name, t in tensors.items():
        target = _hf_name(name)
        if target is None:
            continue
        if t.tensor_type.name not in TYPES:
            raise ModelLoadError(f"weights: gguf holds {', '.join(TYPES)} blocks in int8 panels; "
                                 f"{name} is {t.tensor_type.name}")
        linear = modules.get(target)
        if not isinstance(linear, nn.Linear):
            raise ModelLoadError(f"{name}: the model has no linear {target}")
        rows, cols = linear.out_features, linear.in_features
        q, scale, offset = decode(t.tensor_type.name, t.data, rows, cols)
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(
            name.split(".")[2] if name.startswith("blk.") else "")
        if heads:
            q, scale = _unpermute(q, heads), _unpermute(scale, heads)
            offset = None if offset is None else _unpermute(offset, heads)
        kept[target] = (q, scale, offset)
    _check_and_attach(modules, kept)
    offsets = any(offset is not None for _, _, offset in kept.values())
    logger.info("weights: gguf: %d linears' blocks from %s, 32 weights a scale%s", len(kept),
                gguf_path.name, " and an offset" if offsets else "")
    return len(kept)


def _check_and_attach(modules: dict[str, nn.Module], kept: dict[str, tuple]) -> None:
    missing = [n for n, m in modules.items() if type(m) is nn.Linear and n not in kept]
    if missing:
        raise ModelLoadError(f"weights: gguf: no blocks for {missing[:5]}")
    for target, (q, scale, offset) in kept.items():
        weight = modules[target].weight.detach().float()
        if not torch.allclose(dequantize(q, scale, GROUP, offset), weight, rtol=0,
                              atol=1e-6 * float(weight.abs().max())):
            raise ModelLoadError(f"weights: gguf: {target}'s blocks do not give its weight")
        own = (q, scale) if offset is None else (q, scale, offset)
        setattr(modules[target], CHECKPOINT_INT8, own)
