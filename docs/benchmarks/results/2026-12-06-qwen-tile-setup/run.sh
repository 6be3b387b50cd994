#!/usr/bin/env bash
# the Qwen2-0.5B-shaped model (python -m load_tests.make_model /work/qwen-model), W-short,
# vLLM, the split and the colocated app, bf16, three rounds with the servers' order rotated;
# the app's serve configs are the committed ones with engine.model set to the model's folder
# (PEER: vllm-venv from the peer's setup, smollm2-hf a link to the model's folder).
# TREE: the checkout to serve (here a worktree at d8c2d54: the tile set-up, 8 x 3 bf16
# prefill tiles); R: the results folder (here this one). ../2026-12-06-qwen-decode-attention/
# ran it with TREE=/work/main at 8a73676.
cd "${TREE:-/work/bench-tree}"
R=${R:-/work/main/docs/benchmarks/results/2026-12-06-qwen-tile-setup}
orders=("vllm split colocated" "split colocated vllm" "colocated vllm split")
for r in ${ROUNDS:-1 2 3}; do
  pkill -9 -f gcs_server; pkill -9 -f raylet; pkill -9 -f "ray::"; sleep 3
  SERVERS="${orders[$((r-1))]}" OUT=$R/qwen-r$r VLLM_ARGS="--dtype bfloat16" PEER=/work/peer-qwen \
    PEER_SCRIPTS=/work/shared/peer SERVE_CONFIG_DIR=/work/benchruns/qwen-configs-nice APP_MODEL=/work/qwen-model \
    SKIP_FLOOR=1 load_tests/peer_bench.sh W-short > $R/qwen-r$r.log 2>&1
done
