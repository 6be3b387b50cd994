#!/usr/bin/env bash
# served A/B of two trees: usage: abtree.sh OUT "new old old new ..."; IL OL N C workload; CFG config
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
O=$1; mkdir -p $O
i=0
for t in $2; do
  i=$((i+1)); /work/main/.venv/bin/ray stop --force >/dev/null 2>&1; sleep 2
  d=$O/run$i-$t; mkdir -p $d
  if [ $t = new ]; then T=/work/main; C_=/root/.cache/splitserve; else T=${OLD:-/work/old35}; C_=/work/oldcache; fi
  ( cd $T; export PY=/work/main/.venv/bin/python BIN=/work/main/.venv/bin PYTHONPATH=$T
    [ $t = new ] || export SPLITSERVE_CACHE=$C_
    export OUT=$d; source load_tests/serve_local.sh; start_head; OUT=$d serve_config ${CFG:-local-colocated} || exit 1
    PEER=${PEER:-/work/peer} SERVED=${SERVED:-smollm2-135m-instruct} RESULT_DIR=$d/warm /work/shared/peer/bench.sh warm 8000 64 16 8 8 inf --ignore-eos > $d/warm.log 2>&1
    PEER=${PEER:-/work/peer} SERVED=${SERVED:-smollm2-135m-instruct} RESULT_DIR=$d/warm /work/shared/peer/bench.sh warml 8000 1024 4 2 2 inf --ignore-eos > $d/warml.log 2>&1
    PEER=${PEER:-/work/peer} SERVED=${SERVED:-smollm2-135m-instruct} SEED=${SEED:-2} RESULT_DIR=$d /work/shared/peer/bench.sh w 8000 ${IL:-1024} ${OL:-16} ${N:-16} ${C:-4} inf --ignore-eos > $d/w.log 2>&1 &
    B=$!; sleep ${TS:-4}; python3 "$HERE/threads.py" ${TD:-10} 6 > $d/threads.txt; wait $B
    echo "run$i $t $(date +%T) $(grep -E '^(Output token|Total token|Median TTFT|Median TPOT|P99 ITL)' $d/w.log | awk -F: '{gsub(/ /,"",$2); printf "%s=%s ", substr($1,1,12), $2}')" )
done
/work/main/.venv/bin/ray stop --force >/dev/null 2>&1
