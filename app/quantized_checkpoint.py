"""Checkpoints that already hold int8 weights: the compressed-tensors format's weight-only
int8 (W8A16, as llm-compressor writes it), served through the engine's int8 panels with the
checkpoint's own integers and scales, nothing quantized again.

A compressed-tensors checkpoint's ``config.json`` has a ``quantization_config`` with
``quant_method: compressed-tensors``; each of its ``config_groups`` says how its target
modules' weights were quantized. The engine's int8 panels hold one scale per output channel,
or one per output for each group of k (and then an offset per group too), so it takes
groups of 8-bit symmetric integer weights with the ``channel`` (or ``tensor``) strategy, or
``group`` with an even ``group_size`` up to 512, symmetric or with a zero point (the same
size for every config group; served by the VNNI kernel, elsewhere dequantized to bf16
panels: app.packed_linear.weight_plan), and unquantized activations; anything else (4 bits,
a zero point without groups, an activation order, quantized activations, sparsity) is
refused with what was found. In the safetensors, a
quantized linear ``X`` is ``X.weight_scale`` ([out, 1], one value for the tensor strategy,
[out, ceil(in / group_size)] for the group strategy) beside either
``X.weight`` (int8 [out, in]: the ``int-quantized`` and ``naive-quantized`` formats) or
``X.weight_packed`` (int32 [out, ceil(in / 4)]: ``pack-quantized``, four integers a word,
each stored plus 128 in 8 bits, the first in the lowest) with ``X.weight_shape``; the
weight is ``integer * scale``, or with ``X.weight_zero_point`` (int8, as the scales)
``(integer - zero point) * scale``, which the panels hold as ``integer * scale + offset``
with ``offset = -zero point * scale``. Modules the quantization left out (``ignore``: usually
``lm_head``) are stored dense and load as they are.

The model is built from the checkpoint's config without its ``quantization_config``, over
the dequantized weights (what a fallback path and the fingerprint read), and each quantized
linear keeps the checkpoint's integers and per-output scales in ``CHECKPOINT_INT8`` for
:class:`app.packed_linear.PanelLinear`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from app.config import INT8_MAX_GROUP
from app.errors import ModelLoadError

logger = logging.getLogger(__name__)

# a linear's attribute: (int8 [out, in], float32 scales [out], or [out, groups] grouped, and
# where it has them offsets [out, groups]: app.gguf_blocks)
CHECKPOINT_INT8 = "checkpoint_int8"
FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")
SCHEME = ("8-bit integer weights with one scale per output channel (or per tensor), or "
          f"per group of an even group_size up to {INT8_MAX_GROUP} (then a zero point may "
          "come too), activations unquantized (W8A16)")


def _quant_dict(hf_config: Any) -> dict[str, Any] | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else None


def int8_format(hf_config: Any) -> str | None:
    """The compressed-tensors format(s) of a checkpoint whose linears hold int8 weights the
    engine serves as they are, or None for a checkpoint that is not compressed-tensors.
    Raises ``ModelLoadError`` for a compressed-tensors scheme the int8 panels cannot hold."""
    qc = _quant_dict(hf_config)
    if not qc or qc.get("quant_method") != "compressed-tensors":
        return None
    problems = []
    if qc.get("quantization_status", "compressed") != "compressed":
        problems.append(f"quantization_status {qc.get('quantization_status')!r}")
    if qc.get("sparsity_config"):
        problems.append("a sparsity_config")
    if qc.get("kv_cache_scheme"):
        problems.append("a kv_cache_scheme")
    groups = qc.get("config_groups") or {}
    if not groups:
        problems.append("no config_groups")
    formats = {group.get("format") or qc.get("format") for group in groups.values()}
    for name, group in groups.items():
        problems += [f"{name}: {p}" for p in _group_problems(group)]
    problems += [f"format {f!r} (the engine reads {', '.join(FORMATS)})"
                 for f in sorted(formats - set(FORMATS), key=str)]
    sizes = {_group_size(group) for group in groups.values()}
    if len(sizes) > 1:
        problems.append(f"config groups with different scale groups {sorted(sizes)} (0: per "
                        "channel)")
    if problems:
        raise ModelLoadError(
            "this compressed-tensors checkpoint cannot be served: the engine's int8 panels "
            f"take {SCHEME}; found " + "; ".join(problems))
    return ", ".join(sorted(formats))


def _group_problems(group: dict[str, Any]) -> list[str]:
    w = group.get("weights") or {}
    found = []
    if not w:
        found.append("no weights scheme")
    if w and (w.get("num_bits"), w.get("type")) != (8, "int"):
        found.append(f"weights of {w.get('num_bits')} bits, type {w.get('type')!r}")
    if w and not w.get("symmetric", False) and w.get("strategy") != "group":
        found.append("asymmetric weights (a zero point) without the group strategy")
    size = w.get("group_size")
    if w and w.get("strategy") not in ("channel", "tensor", "group"):
        found.append(f"strategy {w.get('strategy')!r} (group size {size})")
    if w.get("strategy") == "group" and not (
            isinstance(size, int) and size % 2 == 0 and 2 <= size <= INT8_MAX_GROUP):
        found.append(f"group_size {size!r} (even, 2 to {INT8_MAX_GROUP})")
    if w.get("actorder") or w.get("dynamic"):
        found.append("an activation order or dynamic weights")
    if group.get("input_activations") or group.get("output_activations"):
        found.append("quantized activations")
    return found


def _group_size(group: dict[str, Any]) -> int:
    w = group.get("weights") or {}
    return int(w.get("group_size") or 0) if w.get("strategy") == "group" else 0


def int8_group(hf_config: Any) -> int:
    """The k each scale covers in an int8 checkpoint (int8_format) of the ``group``
    strategy, 0 for one scale per output channel (or for another checkpoint)."""
    groups = (_quant_dict(hf_config) or {}).get("config_groups") or {}
    return max((_group_size(group) for group in groups.values()), default=0)


def _shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"no model.safetensors (or its index) in {folder}")


def unpack_int32(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``pack-quantized`` 8-bit words back to int8 [out, in]: four a word, each plus 128,
    the first in the lowest byte."""
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != shape[0]:
        raise ModelLoadError(f"a packed weight of {packed.dtype} {tuple(packed.shape)} "
                             f"does not hold {shape}")
    parts = [((packed >> (8 * i)) & 0xFF) for i in range(4)]
    unsigned = torch.stack(parts, dim=2).reshape(shape[0], -1)[:, :shape[1]]
    return (unsigned - 128).to(torch.int8).contiguous()


def _read(folder: Path, group: int) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """The checkpoint's dense tensors, and (int8, scale [out] or, with a ``group``,
    [out, groups], and where it has a zero point its offsets) by quantized linear."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for shard in _shards(folder):
        try:
            with safe_open(str(shard), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
        except Exception as exc:  # a truncated or foreign file: say which
            raise ModelLoadError(f"could not read {shard}: {exc}") from exc
    quantized: dict[str, tuple] = {}
    for key in [k for k in tensors if k.endswith(".weight_scale")]:
        prefix = key[: -len(".weight_scale")]
        scale = tensors.pop(key).float()
        zero = tensors.pop(prefix + ".weight_zero_point", None)
        zero = zero if zero is not None and bool(zero.any()) else None
        if zero is not None and not group:
            raise ModelLoadError(f"{prefix} has a nonzero zero point without groups: {SCHEME}")
        if prefix + ".weight_g_idx" in tensors:
            raise ModelLoadError(f"{prefix} has an activation order (weight_g_idx)")
        try:
            if prefix + ".weight_packed" in tensors:
                shape = tuple(int(s) for s in tensors.pop(prefix + ".weight_shape").tolist())
                q = unpack_int32(tensors.pop(prefix + ".weight_packed"), shape)
            else:
                q = tensors.pop(prefix + ".weight")
        except KeyError as exc:
            raise ModelLoadError(f"{prefix} has a weight_scale but no {exc}") from exc
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ModelLoadError(f"{prefix}'s weight is {q.dtype} {tuple(q.shape)}, not int8")
        scale = _scales(prefix, scale, q.shape, group)
        offset = None if zero is None else -_scales(prefix, zero.float(), q.shape, group) * scale
        quantized[prefix] = (q, scale) if offset is None else (q, scale, offset)
    return tensors, quantized


def _scales(prefix: str, scale: torch.Tensor, shape: torch.Size, group: int) -> torch.Tensor:
    """A linear's scales as the panels take them: [out], or [out, groups] with a group."""
    if group:
        groups = -(-shape[1] // group)
        if tuple(scale.shape) != (shape[0], groups):
            raise ModelLoadError(f"{prefix}'s scale {tuple(scale.shape)} is not one per "
                                 f"output for each {group} of k of {tuple(shape)}")
        return scale.contiguous()
    if scale.numel() not in (1, shape[0]):
        raise ModelLoadError(f"{prefix}'s scale {tuple(scale.shape)} is not one per "
                             f"output channel of {tuple(shape)}")
    return scale.reshape(-1).expand(shape[0]).contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, group: int = 0,
               offset: torch.Tensor | None = None) -> torch.Tensor:
    """int8 [out, in] times its scales in float32: [out], or with a ``group``
    [out, ceil(in / group)], each over its group of k (the last may be short), plus the
    group's ``offset`` where there is one."""
    if not group:
        return q.float() * scale[:, None]
    w = q.float() * scale.repeat_interleave(group, dim=1)[:, :q.shape[1]]
    return w if offset is None else w + offset.repeat_interleave(group, dim=1)[:, :q.shape[1]]


def load_int8_checkpoint(where: str, hf_config: Any, keep_integers: bool = True):
    """The causal LM of a compressed-tensors int8 checkpoint (a folder or a hub id), in
    float32 over the dequantized weights, each quantized linear keeping the checkpoint's
    integers and scales in ``CHECKPOINT_INT8`` where ``keep_integers`` (int8 panels will
    take them; elsewhere they would only hold memory)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = Path(where)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(where, allow_patterns=["*.json", "*.safetensors"]))
    group = int8_group(hf_config)
    dense, quantized = _read(folder, group)
    state = {k: v.float() if v.is_floating_point() else v for k, v in dense.items()}
    for prefix, (q, scale, *offset) in quantized.items():
        state[prefix + ".weight"] = dequantize(q, scale, group, *offset)
    config = type(hf_config).from_dict({k: v for k, v in hf_config.to_dict().items()
                                        if k != "quantization_config"})
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError as exc:
        raise ModelLoadError(f"no causal LM class for {type(config).__name__}") from exc
    model = cls.from_pretrained(None, config=config, state_dict=state, dtype=torch.float32,
                                attn_implementation="sdpa")
    modules = dict(model.named_modules())
    missing = [p for p in quantized if not isinstance(modules.get(p), torch.nn.Linear)]
    if missing:
        raise ModelLoadError(f"quantized weights for modules the model has no linear for: "
                             f"{missing[:5]}")
    for prefix, pair in quantized.items():
        if keep_integers:
            setattr(modules[prefix], CHECKPOINT_INT8, pair)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    logger.info("int8 checkpoint: %d linears' integers and scales taken as they are",
                len(quantized))
    return model
