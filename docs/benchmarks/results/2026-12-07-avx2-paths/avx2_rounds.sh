#!/usr/bin/env bash
# An AVX2-only CPU emulated on one with AVX-512 (both sides capped, every process):
#   this app: SPLITSERVE_KERNEL_ISA=avx2 (the engine's kernels), ATEN_CPU_CAPABILITY=avx2
#   vLLM: sitecustomize.py in this folder (AVX2_SHIM=1: torch's AVX-512/AMX probes answer
#         False, so vLLM loads _C_AVX2), ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2
#   both: MKL_ENABLE_INSTRUCTIONS=AVX2
# Servers, one at a time, the order rotated each round: the split app at float32 and at
# bfloat16 (CFG=<folder of serve configs with engine.dtype set>), vLLM at bfloat16 and at
# float32; workloads W-single and W-short (load_tests/peer_bench.sh).
#   R=<results folder> CFG_F32=<dir> CFG_BF16=<dir> [ROUNDS=3] [SERVERS="a b c d"] avx2_rounds.sh
set -u
R=${R:?}; mkdir -p "$R"
HERE=$(cd "$(dirname "$0")" && pwd)
export SPLITSERVE_KERNEL_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
  MKL_ENABLE_INSTRUCTIONS=AVX2 AVX2_SHIM=1 PYTHONPATH=$HERE
all=(${SERVERS:-split-f32 split-bf16 vllm-bf16 vllm-f32})
for r in $(seq 1 "${ROUNDS:-3}"); do
  for i in $(seq 0 $((${#all[@]} - 1))); do
    s=${all[$(( (i + r - 1) % ${#all[@]} ))]}
    /work/main/.venv/bin/ray stop --force >/dev/null 2>&1; pkill -9 -f gcs_server; pkill -9 -f raylet; sleep 3
    out=$R/round-$r/$s
    case $s in
      split-*) cfg=$([ $s = split-f32 ] && echo "$CFG_F32" || echo "$CFG_BF16")
        (cd /work/main && SERVERS=split SERVE_CONFIG_DIR=$cfg PEER=${PEER:-/work/peer} OUT=$out \
          PEER_SCRIPTS=/work/shared/peer SKIP_FLOOR=1 load_tests/peer_bench.sh W-single W-short \
          > "$R/r$r-$s.log" 2>&1) ;;
      vllm-*) dt=$([ $s = vllm-f32 ] && echo float32 || echo bfloat16)
        (cd /work/main && SERVERS=vllm VLLM_ARGS="--dtype $dt" PEER=${PEER:-/work/peer} OUT=$out \
          PEER_SCRIPTS=/work/shared/peer SKIP_FLOOR=1 load_tests/peer_bench.sh W-single W-short \
          > "$R/r$r-$s.log" 2>&1) ;;
    esac
    echo "round $r $s rc=$? $(date +%T)"
  done
done
