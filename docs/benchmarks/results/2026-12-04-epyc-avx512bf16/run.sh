#!/usr/bin/env bash
# three rounds per model, server order rotated, vLLM and this app both at bf16
cd /work/main
orders=("vllm split colocated" "split colocated vllm" "colocated vllm split")
for r in 1 2 3; do
  SERVERS="${orders[$((r-1))]}" OUT=/work/benchruns/final/smollm-r$r VLLM_ARGS="--dtype bfloat16" PEER=/work/peer \
    flock /tmp/splitserve-ray-cluster.lock load_tests/peer_bench.sh W-single W-short W-long > /work/benchruns/final/smollm-r$r.log 2>&1
done
for r in 1 2 3; do
  SERVERS="${orders[$((r-1))]}" OUT=/work/benchruns/final/qwen-r$r VLLM_ARGS="--dtype bfloat16" PEER=/work/peer-qwen \
    PEER_SCRIPTS=/work/shared/peer SERVE_CONFIG_DIR=/work/benchruns/qwen-configs APP_MODEL=/work/qwen-model \
    flock /tmp/splitserve-ray-cluster.lock load_tests/peer_bench.sh W-single W-short W-long > /work/benchruns/final/qwen-r$r.log 2>&1
done
echo done > /work/benchruns/final/finished
