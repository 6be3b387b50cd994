#!/usr/bin/env bash
# the Qwen2-0.5B-shaped model (python -m load_tests.make_model /work/qwen-model), W-short with
# the decode thread at nice -10 (commit 74e1194): vLLM and the split (the colocated
# app is unchanged by it), at bf16, rounds with the servers' order alternated; the app's serve configs are the
# committed ones with engine.model set to the model's folder (PEER: vllm-venv from the peer's
# setup, smollm2-hf a link to the model's folder)
cd /work/main
R=docs/benchmarks/results/2026-12-05-qwen-decode-nice
orders=("vllm split" "split vllm" "vllm split")
for r in ${ROUNDS:-1 2 3}; do
  SERVERS="${orders[$((r-1))]}" OUT=$R/qwen-r$r VLLM_ARGS="--dtype bfloat16" PEER=/work/peer-qwen \
    PEER_SCRIPTS=/work/shared/peer SERVE_CONFIG_DIR=/work/benchruns/qwen-configs-nice APP_MODEL=/work/qwen-model \
    SKIP_FLOOR=1 load_tests/peer_bench.sh W-short > $R/qwen-r$r.log 2>&1
done
echo done > $R/finished
