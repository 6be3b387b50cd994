#!/usr/bin/env bash
# the Qwen2-0.5B-shaped model (python -m load_tests.make_model /work/qwen-model; config in
# ../2026-12-04-epyc-avx512bf16/qwen2-0.5b-shaped-config.json), W-short after the token feed,
# three rounds with the servers' order alternated, vLLM and the split app both at bf16; the
# serve configs are the committed ones with engine.model set to the model's folder
cd /work/main
R=docs/benchmarks/results/2026-12-05-qwen-token-feed
orders=("vllm split" "split vllm" "vllm split")
for r in 1 2 3; do
  SERVERS="${orders[$((r-1))]}" OUT=$R/qwen-r$r VLLM_ARGS="--dtype bfloat16" PEER=/work/peer-qwen \
    PEER_SCRIPTS=/work/shared/peer SERVE_CONFIG_DIR=/work/benchruns/qwen-configs APP_MODEL=/work/qwen-model \
    SKIP_FLOOR=1 flock /tmp/splitserve-ray-cluster.lock load_tests/peer_bench.sh W-short > $R/qwen-r$r.log 2>&1
done
echo done > $R/finished
