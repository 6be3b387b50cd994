#!/usr/bin/env bash
# the Qwen2-0.5B-shaped model (python -m load_tests.make_model /work/qwen-model), W-short after
# the row blocks (commit 910926d; the code as at af72830): vLLM, the split and the colocated
# app, all at bf16, rounds with the servers' order rotated; the app's serve configs are the
# committed ones with engine.model set to the model's folder (PEER: vllm-venv from the peer's
# setup, smollm2-hf a link to the model's folder)
cd /work/main
R=docs/benchmarks/results/2026-12-05-qwen-row-blocks
orders=("vllm split colocated" "split colocated vllm" "colocated vllm split")
for r in ${ROUNDS:-1 2 3}; do
  SERVERS="${orders[$((r-1))]}" OUT=$R/qwen-r$r VLLM_ARGS="--dtype bfloat16" PEER=/work/peer-qwen \
    PEER_SCRIPTS=/work/shared/peer SERVE_CONFIG_DIR=/work/benchruns/qwen-configs APP_MODEL=/work/qwen-model \
    SKIP_FLOOR=1 load_tests/peer_bench.sh W-short > $R/qwen-r$r.log 2>&1
done
echo done > $R/finished
