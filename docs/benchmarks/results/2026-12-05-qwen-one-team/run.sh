#!/usr/bin/env bash
# the Qwen2-0.5B-shaped model (python -m load_tests.make_model /work/qwen-model), W-short and
# W-single, vLLM and the colocated app at commit cc9c694 (one OpenMP team), bf16, rounds with
# the servers' order alternated; the app's serve configs are the committed ones with
# engine.model set to the model's folder (PEER: vllm-venv from the peer's setup, smollm2-hf a
# link to the model's folder)
cd /work/bench-tree
R=/work/scratch/s4/qwen
orders=("vllm colocated" "colocated vllm" "vllm colocated")
for r in ${ROUNDS:-1 2 3}; do
  pkill -9 -f gcs_server; pkill -9 -f raylet; pkill -9 -f "ray::"; sleep 2
  SERVERS="${orders[$((r-1))]}" OUT=$R/qwen-r$r VLLM_ARGS="--dtype bfloat16" PEER=/work/peer-qwen \
    PEER_SCRIPTS=/work/shared/peer SERVE_CONFIG_DIR=/work/benchruns/qwen-configs-nice APP_MODEL=/work/qwen-model \
    SKIP_FLOOR=1 load_tests/peer_bench.sh W-short W-single > $R/qwen-r$r.log 2>&1
done
echo done > $R/finished
