#!/usr/bin/env bash
# W-long beside vLLM (bf16), the colocated app at main only, three rounds, the order rotated
# (a second hour's reading of wlong/run.sh's pair).
#   R=<results folder> docs/benchmarks/results/2026-12-06-mixed-pass-kv/wlong2/run.sh
R=${R:?}; mkdir -p $R
orders=("vllm colocated" "colocated vllm" "vllm colocated")
for r in 1 2 3; do
  for s in ${orders[$((r-1))]}; do
    /work/main/.venv/bin/ray stop --force >/dev/null 2>&1; pkill -9 -f gcs_server; pkill -9 -f raylet; sleep 3
    extra=(); [ $s = vllm ] && extra=(VLLM_ARGS="--dtype bfloat16")
    (cd /work/main && env PEER=/work/peer SERVERS=$s OUT=$R/round-$r "${extra[@]}" PEER_SCRIPTS=/work/shared/peer SKIP_FLOOR=1 load_tests/peer_bench.sh W-long > $R/r$r-$s.log 2>&1)
    echo "round $r $s rc=$? $(date +%T)"
  done
done
