#!/usr/bin/env bash
# A/B of the switch interval: served W-short (N prompts), colocated; usage: ab.sh OUT "0 0.0005 0 0.0005"
set -u
O=$1; mkdir -p $O; cd /work/main
i=0
for sw in $2; do
  i=$((i+1)); ray stop --force >/dev/null 2>&1; sleep 2
  d=$O/run$i-sw$sw; mkdir -p $d
  ( if [ "$sw" = y ]; then export RAY_worker_niceness=0; fi
    export OUT=$d; source load_tests/serve_local.sh; start_head; OUT=$d serve_config ${CFG:-local-colocated} || exit 1
    PEER=${PEER:-/work/peer} SERVED=${SERVED:-smollm2-135m-instruct} RESULT_DIR=$d/warm /work/shared/peer/bench.sh warm 8000 64 16 8 8 inf --ignore-eos > $d/warm.log 2>&1
    PEER=${PEER:-/work/peer} SERVED=${SERVED:-smollm2-135m-instruct} RESULT_DIR=$d /work/shared/peer/bench.sh wshort 8000 ${IL:-64} ${OL:-64} ${N:-128} ${C:-8} inf --ignore-eos > $d/wshort.log 2>&1 &
    B=$!; sleep ${TS:-6}; /work/tools/bin/python /work/prof/threads.py 15 > $d/threads.txt; wait $B
    echo "run$i sw=$sw $(grep -E '^(Output token|Total token|Median TTFT|Median TPOT|P99 ITL)' $d/wshort.log | awk -F: '{gsub(/ /,"",$2); printf "%s=%s ", substr($1,1,12), $2}')"
    grep -c "switch interval" $d/*serve.log /tmp/ray/session_latest/logs/*.err 2>/dev/null | grep -v ":0" | head -2 )
done
ray stop --force >/dev/null 2>&1
