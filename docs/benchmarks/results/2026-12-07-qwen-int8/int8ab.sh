#!/usr/bin/env bash
# W-single on the Qwen-shaped model: the split at bf16 (a) and with weights: int8 (b), a b b a
R=/work/main/docs/benchmarks/results/2026-12-07-qwen-int8; mkdir -p $R
i=0
for s in a b b a; do
  i=$((i+1)); cfg=/work/benchruns/qwen-configs; [ $s = b ] && cfg=/work/benchruns/qwen-int8
  /work/main/.venv/bin/ray stop --force >/dev/null 2>&1; sleep 3
  (cd /work/main && env PEER=/work/peer-qwen SERVERS=split OUT=$R/run$i-$s SERVE_CONFIG_DIR=$cfg \
    APP_MODEL=/work/qwen-model SKIP_FLOOR=1 PEER_SCRIPTS=/work/shared/peer \
    load_tests/peer_bench.sh W-single > $R/run$i-$s.log 2>&1)
  echo "run $i $s rc=$? $(date +%T)"
done
