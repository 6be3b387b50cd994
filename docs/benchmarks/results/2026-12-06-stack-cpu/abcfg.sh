#!/usr/bin/env bash
# served A/B of two config dirs (A=$CA, B=$CB): usage: abcfg.sh OUT "a b b a"; IL OL N C SEED workload; CFG config name
set -u
O=$1; mkdir -p $O; cd /work/main
i=0
for t in $2; do
  i=$((i+1)); ray stop --force >/dev/null 2>&1; sleep 2
  d=$O/run$i-$t; mkdir -p $d
  if [ $t = a ]; then D=$CA; else D=$CB; fi
  ( export OUT=$d; source load_tests/serve_local.sh; start_head; SERVE_CONFIG_DIR=$D OUT=$d serve_config ${CFG:-local} || exit 1
    PEER=${PEER:-/work/peer-qwen} SERVED=${SERVED:-/work/qwen-model} RESULT_DIR=$d/warm /work/shared/peer/bench.sh warm 8000 64 16 8 8 inf --ignore-eos > $d/warm.log 2>&1
    PEER=${PEER:-/work/peer-qwen} SERVED=${SERVED:-/work/qwen-model} SEED=${SEED:-1} RESULT_DIR=$d /work/shared/peer/bench.sh w 8000 ${IL:-64} ${OL:-64} ${N:-64} ${C:-8} inf --ignore-eos > $d/w.log 2>&1
    echo "run$i $t $(date +%T) $(grep -E '^(Output token|Total token|Median TTFT|Median TPOT|P99 ITL)' $d/w.log | awk -F: '{gsub(/ /,"",$2); printf "%s=%s ", substr($1,1,12), $2}')" )
done
ray stop --force >/dev/null 2>&1
