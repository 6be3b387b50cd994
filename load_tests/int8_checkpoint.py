"""Write a model as a compressed-tensors int8 weight-only checkpoint (W8A16), the way
llm-compressor's min-max scheme writes one: every linear but ``lm_head`` as 8-bit symmetric
integers with one scale per output channel (largest magnitude / 127.5, integers in
[-128, 127]), or with ``--group N`` one per output for each N of k (the ``group`` strategy,
scales [out, ceil(in / N)]; ``--asymmetric``: and a zero point per group, min-max over 255
steps), packed four to a 32-bit word (``pack-quantized``) or kept as int8
(``int-quantized``); the rest as it is. The engine serves such a folder's own integers
(app.quantized_checkpoint); this writes one where no quantizer is installed, for the tests
and for BENCHMARKS' quality figures.

    python -m load_tests.int8_checkpoint OUT_DIR [--model smollm2-135m-instruct]
        [--format pack-quantized] [--group N [--asymmetric]]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

GROUP = {"targets": ["Linear"], "input_activations": None, "output_activations": None,
         "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                     "group_size": None, "dynamic": False, "actorder": None,
                     "observer": "minmax"}}


def quantize(w: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max symmetric int8, a scale per row (int8 [out, in], scale [out, 1]), or with a
    ``group`` per row for each ``group`` of k (scale [out, ceil(in / group)])."""
    if not group:
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.5
        return torch.clamp(torch.round(w / scale), -128, 127).to(torch.int8), scale
    n, k = w.shape
    blocks = nn.functional.pad(w, (0, -k % group)).view(n, -1, group)
    scale = blocks.abs().amax(dim=2).clamp(min=1e-12) / 127.5
    q = torch.clamp(torch.round(blocks / scale[:, :, None]), -128, 127).view(n, -1)[:, :k]
    return q.to(torch.int8).contiguous(), scale


def quantize_asymmetric(w: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """Min-max int8 with a scale and a zero point per row for each ``group`` of k, as
    compressed-tensors defines them (``w ~= (q - zero) * scale``): (int8 [out, in], scale and
    zero point [out, groups])."""
    n, k = w.shape
    blocks = nn.functional.pad(w, (0, -k % group)).view(n, -1, group)
    lo, hi = blocks.amin(dim=2).clamp(max=0), blocks.amax(dim=2).clamp(min=0)
    scale = ((hi - lo) / 255).clamp(min=1e-12)
    zero = torch.clamp(torch.round(-128 - lo / scale), -128, 127)
    q = torch.clamp(torch.round(blocks / scale[:, :, None]) + zero[:, :, None], -128, 127)
    return q.view(n, -1)[:, :k].to(torch.int8).contiguous(), scale, zero.to(torch.int8)


def pack(q: torch.Tensor) -> torch.Tensor:
    """Four integers a 32-bit word, each plus 128, the first in the lowest byte."""
    u = q.to(torch.int32) + 128
    u = nn.functional.pad(u, (0, -u.shape[1] % 4)).view(u.shape[0], -1, 4)
    return (u << torch.tensor([0, 8, 16, 24], dtype=torch.int32)).sum(2, dtype=torch.int32)


def write(model: nn.Module, folder: Path, fmt: str = "pack-quantized", tokenizer=None,
          group: int = 0, asymmetric: bool = False,
          **scheme: object) -> dict[str, tuple[torch.Tensor, ...]]:
    """``model``'s linears but lm_head as int8 in ``fmt``, a scale per output or per
    ``group`` of k, with ``asymmetric`` a zero point per group too (``scheme`` overrides what
    the config says of the weights); returns the integers and scales (float32 [out],
    [out, groups] with a group) written, and with zero points the offsets the panels take
    (``-zero * scale``), by module name."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
             or not model.config.tie_word_embeddings}
    tensors, written = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":
            w = state.pop(name + ".weight").float()
            q, scale, zero = (quantize_asymmetric(w, group) if asymmetric
                              else (*quantize(w, group), None))
            if fmt == "pack-quantized":
                tensors[name + ".weight_packed"] = pack(q)
                tensors[name + ".weight_shape"] = torch.tensor(q.shape, dtype=torch.int32)
            else:
                tensors[name + ".weight"] = q
            tensors[name + ".weight_scale"] = scale.bfloat16()
            kept = scale.bfloat16().float()
            written[name] = (q, kept if group else kept.reshape(-1))
            if zero is not None:
                tensors[name + ".weight_zero_point"] = zero
                written[name] += (-zero.float() * kept,)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({**state, **tensors}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    how = json.loads(json.dumps(GROUP))
    if group:
        how["weights"].update(strategy="group", group_size=group, symmetric=not asymmetric)
    how["weights"].update(scheme)
    config = model.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": how}, "ignore": ["lm_head"], "kv_cache_scheme": None}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return written


def main(argv: list[str] | None = None) -> int:
    from app.config import DEFAULT_MODEL, EngineConfig, KernelConfig
    from app.model_loader import load_model, load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--format", choices=("pack-quantized", "int-quantized"),
                    default="pack-quantized")
    ap.add_argument("--group", type=int, default=0,
                    help="a scale per output for each GROUP of k (0: per output channel)")
    ap.add_argument("--asymmetric", action="store_true",
                    help="with --group: a zero point per group too")
    args = ap.parse_args(argv)
    config = EngineConfig(model=args.model, dtype="float32", kernels=KernelConfig(linear="torch"))
    if args.asymmetric and not args.group:
        ap.error("--asymmetric needs --group")
    written = write(load_model(config), args.out, args.format, load_tokenizer(config),
                    args.group, args.asymmetric)
    per = f"a scale per {args.group} of k" if args.group else "a scale per output"
    per += ", a zero point per group" if args.asymmetric else ""
    print(f"{len(written)} linears as int8 ({args.format}, {per}) in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
