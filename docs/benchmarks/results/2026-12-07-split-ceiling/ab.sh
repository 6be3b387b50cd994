#!/bin/bash
# usage: ab.sh OUTROOT "a b b a"   ; side a: env ENV_A, side b: env ENV_B; CFG, SERVE_CONFIG_DIR, N, PORT_B
ROOT=$1; ORDER=$2; i=0
for side in $ORDER; do
  i=$((i+1)); O=$ROOT/run$i-$side; mkdir -p $O
  if [ $side = a ]; then E="$ENV_A"; P=${PORT_A:-8000}; C=$CA; else E="$ENV_B"; P=${PORT_B:-8000}; C=$CB; fi
  ( cd /work/main; [ -n "$E" ] && export $E; export OUT=$O SERVE_CONFIG_DIR=$C; source load_tests/serve_local.sh; start_head; serve_config ${CFG:-local} || exit 1
    if [ "$P" != 8000 ]; then sleep 5; fi
    ss -ltnp 2>/dev/null | grep -E ":(8000|30[0-9]{3})" > $O/ports.txt
    $PY -m load_tests.loadgen --base-url http://127.0.0.1:$P --endpoint completions --input-len 64 --output-len 64 --concurrency 8 --num-requests 16 --no-plots --no-progress --out $O/warm >/dev/null 2>&1
    $PY -m load_tests.loadgen --base-url http://127.0.0.1:$P --endpoint completions --input-len 64 --output-len 64 --concurrency 8 --num-requests ${N:-96} --no-plots --no-progress --out $O/load > $O/load.log 2>&1 &
    LG=$!; sleep 8; $PY docs/benchmarks/results/2026-12-06-stack-cpu/threads.py 20 60 > $O/threads.txt; wait $LG
    curl -s http://127.0.0.1:$P/debug/requests > $O/traces.json )
  echo "$side $(grep overall $O/load.log)"
done
