#!/bin/bash
# usage: OUT=/work/prof/X CFG=local [SERVE_CONFIG_DIR=...] run.sh
cd /work/main
source load_tests/serve_local.sh
start_head
serve_config ${CFG:-local} || exit 1
T=/work/main/docs/benchmarks/results/2026-12-06-stack-cpu
$PY -m load_tests.loadgen --endpoint completions --input-len 64 --output-len 64 --concurrency 8 --num-requests 16 --no-plots --no-progress --out $OUT/warm >/dev/null 2>&1
$PY -m load_tests.loadgen --endpoint completions --input-len 64 --output-len 64 --concurrency 8 --num-requests ${N:-160} --no-plots --no-progress --out $OUT/load > $OUT/load.log 2>&1 &
LG=$!
sleep 8
$PY $T/threads.py 20 40 > $OUT/threads.txt &
if [ -n "$SPY" ]; then
  for name in ProxyActor Ingress DecodeServer ColocatedServer; do
    pid=$(pgrep -f "ray::.*$name" | head -1 || true)
    pid=${pid:-$(pgrep -f "$name" | head -1)}
    [ -n "$pid" ] && $BIN/py-spy record -p $pid -d 15 -r ${RATE:-50} ${SPYFLAGS} -f raw -o $OUT/spy-$name.txt --nonblocking >$OUT/spy-$name.log 2>&1 &
  done
fi
wait $LG
wait
curl -s $URL/debug/requests > $OUT/traces.json
ps -eLo pid,tid,ni,comm,args --sort=-pcpu | head -40 > $OUT/ps.txt
tail -30 $OUT/load.log
