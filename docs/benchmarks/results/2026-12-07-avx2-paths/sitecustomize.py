# Emulates an AVX2-only x86 CPU for vLLM on a CPU with AVX-512 (AVX2_SHIM=1): torch's
# capability probes that vLLM consults answer False, so it loads its _C_AVX2 kernels and
# takes its non-AVX-512 paths; oneDNN, MKL and ATen are capped by their own variables
# (ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS, ATEN_CPU_CAPABILITY).
import os

if os.environ.get("AVX2_SHIM") == "1":
    import torch.cpu as _cpu

    for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported",
                  "_is_avx512_vnni_supported", "_is_amx_tile_supported",
                  "_is_amx_fp16_supported", "_is_arm_sve_supported"):
        if hasattr(_cpu, _name):
            setattr(_cpu, _name, lambda: False)
