"""This engine's reading of a compressed-tensors int8 checkpoint against the library's own.

    pip install --target /tmp/ct --no-deps compressed-tensors==0.20.1 loguru
    python -m load_tests.int8_checkpoint /tmp/w8a16            # SmolLM2 as W8A16
    PYTHONPATH=/tmp/ct python docs/benchmarks/results/2026-12-07-int8-checkpoint/crosscheck.py /tmp/w8a16

1. the packed words: load_tests.int8_checkpoint.pack against compressed-tensors'
   pack_to_int32, and each side's unpacking of the other's;
2. the model: transformers' from_pretrained with compressed-tensors installed (the library
   decompresses) against app.quantized_checkpoint.load_int8_checkpoint: every weight, and
   the logits over a few prompts.
"""
import sys

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig

from app.quantized_checkpoint import load_int8_checkpoint, unpack_int32
from load_tests.int8_checkpoint import pack, quantize

folder = sys.argv[1]
torch.manual_seed(0)
q, _ = quantize(torch.randn(96, 77))
print("packed words equal compressed-tensors':", torch.equal(pack(q), pack_to_int32(q, 8)))
print("ours unpacks theirs:", torch.equal(unpack_int32(pack_to_int32(q, 8), tuple(q.shape)), q))
print("theirs unpacks ours:", torch.equal(unpack_from_int32(pack(q), 8, q.shape), q))

theirs = AutoModelForCausalLM.from_pretrained(  # decompressed into plain weights
    folder, dtype=torch.float32,
    quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
ours = load_int8_checkpoint(folder, AutoConfig.from_pretrained(folder)).eval()
linears = {n: m for n, m in theirs.named_modules() if isinstance(m, torch.nn.Linear)}
worst, worst_rounded = 0.0, 0.0
for name, module in ours.named_modules():
    if isinstance(module, torch.nn.Linear) and name != "lm_head":  # lm_head: dense, tied
        w = linears[name].weight
        worst = max(worst, (w - module.weight).abs().max().item())
        # the library dequantizes in the scale's dtype (bf16 here): ours rounded the same
        rounded = module.weight.to(w.dtype if w.dtype != torch.float32 else torch.bfloat16)
        worst_rounded = max(worst_rounded, (w - rounded.float()).abs().max().item())
print(f"{len(linears) - 1} int8 linears, largest weight difference: {worst}; "
      f"with ours rounded to bf16 as the library's dequantize rounds: {worst_rounded}")
ids = torch.tensor([[1, 504, 3458, 282, 4649, 314], [1, 2000, 30, 17, 9, 800]])
with torch.no_grad():
    diff = (theirs(ids).logits - ours(ids).logits).abs().max().item()
print(f"largest logit difference over {ids.numel()} positions: {diff}")
for name, module in ours.named_modules():  # the same rounding as the library's: all else equal?
    if isinstance(module, torch.nn.Linear) and name != "lm_head":
        module.weight.data = module.weight.data.bfloat16().float()
with torch.no_grad():
    diff = (theirs(ids).logits - ours(ids).logits).abs().max().item()
print(f"with ours rounded to bf16 likewise: {diff}")
