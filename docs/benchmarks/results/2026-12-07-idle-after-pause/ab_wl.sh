#!/bin/bash
# needs measurement.patch applied (SPLITSERVE_IDLE_OLD=1 restores the code before d8c350d)
# ab_wl.sh ROOT "a b b a": W-long-like runs (1024 in / 16 out, 4 concurrent, 16 prompts); a: SPLITSERVE_IDLE_OLD=1
ROOT=$1; ORDER=$2; i=0
for side in $ORDER; do
  i=$((i+1)); O=$ROOT/run$i-$side; mkdir -p $O
  if [ $side = a ]; then E="SPLITSERVE_IDLE_OLD=1"; else E="SPLITSERVE_IDLE_NEW=1"; fi
  ( export $E; cd /work/main; export OUT=$O; source load_tests/serve_local.sh; start_head; serve_config ${CFG:-local} || exit 1
    $PY -m load_tests.loadgen --endpoint completions --input-len 1024 --output-len 16 --concurrency 4 --num-requests 4 --no-plots --no-progress --out $O/warm >/dev/null 2>&1
    $PY -m load_tests.loadgen --endpoint completions --input-len 1024 --output-len 16 --concurrency 4 --num-requests 16 --no-plots --no-progress --out $O/load > $O/load.log 2>&1 )
  echo "$side $(grep overall $O/load.log)"
done
