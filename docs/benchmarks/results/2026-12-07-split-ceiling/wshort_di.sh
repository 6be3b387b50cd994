#!/usr/bin/env bash
# W-short beside vLLM (bf16): vLLM, an app served through Serve's proxy, and the same app
# with Serve's direct ingress (DIRECT_INGRESS_PORT=30000: RAY_SERVE_ENABLE_DIRECT_INGRESS=1 at
# `ray start`, the client on the ingress replica's own port), rounds with the order rotated. The direct
# run's results go into each round as <APP>-direct_W-short.json.
#   R=<results folder> [APP=colocated] [ORDERS="a b|b a"] [PEER=/work/peer]
#     [CONFIGS=serve_configs] [APP_MODEL=smollm2-135m-instruct] wshort_di.sh
# For the Qwen2-0.5B-shaped model: PEER=/work/peer-qwen (the peer's folder, smollm2-hf
# linking the model), CONFIGS=<the committed configs with engine.model the model's folder>,
# APP_MODEL=<that folder> (as in ../2026-12-07-mixed-one-call/wshort.sh).
R=${R:?}; mkdir -p $R; app=${APP:-colocated}
IFS='|' read -r -a orders <<< "${ORDERS:-vllm app direct|direct vllm app|app direct vllm}"
for r in $(seq 1 ${#orders[@]}); do
  for s in ${orders[$((r-1))]}; do
    /work/main/.venv/bin/ray stop --force >/dev/null 2>&1; pkill -9 -f gcs_server; pkill -9 -f raylet; sleep 3
    srv=$s; out=$R/round-$r; extra=()
    [ $s = app ] && srv=$app
    [ $s = direct ] && srv=$app && out=$R/direct-$r && \
      extra=(DIRECT_INGRESS_PORT=30000)
    (cd /work/main && env "${extra[@]}" PEER=${PEER:-/work/peer} SERVERS=$srv OUT=$out \
      VLLM_ARGS="--dtype bfloat16" PEER_SCRIPTS=/work/shared/peer \
      SERVE_CONFIG_DIR=${CONFIGS:-serve_configs} APP_MODEL=${APP_MODEL:-smollm2-135m-instruct} \
      SKIP_FLOOR=1 load_tests/peer_bench.sh W-short > $R/r$r-$s.log 2>&1)
    echo "round $r $s rc=$? $(date +%T)"
    [ $s = direct ] && mkdir -p $R/round-$r && cp $out/${app}_W-short.json $R/round-$r/${app}-direct_W-short.json
  done
done
