#!/usr/bin/env bash
# W-short beside vLLM (bf16): vLLM, the split and the colocated app at main, and one of them
# (OLD_SERVER, split by default) at an earlier commit (old: a worktree at /work/old-tree
# sharing main's .venv; f92fe9d here), rounds with the order rotated; `old`'s results go
# into each round as <OLD_SERVER>-old_W-short.json.
#   R=<results folder> [ORDERS="a b|b a"] [OLD_SERVER=split] [PEER=/work/peer]
#     [CONFIGS=serve_configs] [APP_MODEL=smollm2-135m-instruct] wshort.sh
# qwen-wshort/: the Qwen2-0.5B-shaped model (python -m load_tests.make_model /work/qwen-model),
#   PEER=/work/peer-qwen (the peer's folder with smollm2-hf linking the model),
#   CONFIGS=/work/benchruns/qwen-configs (the committed configs, engine.model the folder),
#   APP_MODEL=/work/qwen-model. smollm2-wshort/: the defaults, OLD_SERVER=colocated.
R=${R:?}; mkdir -p $R; old=${OLD_SERVER:-split}
IFS='|' read -r -a orders <<< "${ORDERS:-vllm split colocated old|old vllm split colocated|colocated old vllm split}"
for r in $(seq 1 ${#orders[@]}); do
  for s in ${orders[$((r-1))]}; do
    /work/main/.venv/bin/ray stop --force >/dev/null 2>&1; pkill -9 -f gcs_server; pkill -9 -f raylet; sleep 3
    tree=/work/main; srv=$s; out=$R/round-$r
    [ $s = old ] && tree=/work/old-tree && srv=$old && out=$R/old-$r
    (cd $tree && env PEER=${PEER:-/work/peer} SERVERS=$srv OUT=$out VLLM_ARGS="--dtype bfloat16" \
      PEER_SCRIPTS=/work/shared/peer SERVE_CONFIG_DIR=${CONFIGS:-serve_configs} \
      APP_MODEL=${APP_MODEL:-smollm2-135m-instruct} SKIP_FLOOR=1 \
      load_tests/peer_bench.sh W-short > $R/r$r-$s.log 2>&1)
    echo "round $r $s rc=$? $(date +%T)"
    [ $s = old ] && mkdir -p $R/round-$r && cp $out/${old}_W-short.json $R/round-$r/${old}-old_W-short.json
  done
done
