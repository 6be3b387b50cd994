#!/usr/bin/env bash
# W-short on the Qwen2-0.5B-shaped model (python -m load_tests.make_model /work/qwen-model),
# bf16: vLLM, the split and the colocated app at main, and the split at an earlier commit
# (old: a worktree at /work/old-tree sharing main's .venv), rounds with the order rotated.
# PEER: a peer folder whose smollm2-hf links the model; CONFIGS: the committed serve configs
# with engine.model set to the model's folder.
#   R=<results folder> [ORDERS="a b|b a"] [PEER=/work/peer-qwen] [CONFIGS=/work/benchruns/qwen-configs] run.sh
R=${R:?}; mkdir -p $R
IFS='|' read -r -a orders <<< "${ORDERS:-vllm split colocated old|old vllm split colocated|colocated old vllm split}"
for r in $(seq 1 ${#orders[@]}); do
  for s in ${orders[$((r-1))]}; do
    /work/main/.venv/bin/ray stop --force >/dev/null 2>&1; pkill -9 -f gcs_server; pkill -9 -f raylet; sleep 3
    extra=(); tree=/work/main; srv=$s; out=$R/round-$r
    [ $s = old ] && tree=/work/old-tree && srv=split && out=$R/old-$r
    (cd $tree && env PEER=${PEER:-/work/peer-qwen} SERVERS=$srv OUT=$out VLLM_ARGS="--dtype bfloat16" \
      PEER_SCRIPTS=/work/shared/peer SERVE_CONFIG_DIR=${CONFIGS:-/work/benchruns/qwen-configs} \
      APP_MODEL=/work/qwen-model SKIP_FLOOR=1 load_tests/peer_bench.sh W-short > $R/r$r-$s.log 2>&1)
    echo "round $r $s rc=$? $(date +%T)"
    [ $s = old ] && mkdir -p $R/round-$r && cp $out/split_W-short.json $R/round-$r/split-old_W-short.json
  done
done
