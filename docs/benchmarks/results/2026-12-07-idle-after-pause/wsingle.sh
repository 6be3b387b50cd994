#!/bin/bash
# OUT=... [CFG=local] wsingle.sh : one served W-single-like run (conc 1, 64 in / 128 out) with traces
cd /work/main
source load_tests/serve_local.sh
start_head
serve_config ${CFG:-local} || exit 1
P=${PORT:-8000}
$PY -m load_tests.loadgen --base-url http://127.0.0.1:$P --endpoint completions --input-len 64 --output-len 128 --concurrency 1 --num-requests 4 --no-plots --no-progress --out $OUT/warm >/dev/null 2>&1
$PY -m load_tests.loadgen --base-url http://127.0.0.1:$P --endpoint completions --input-len 64 --output-len 128 --concurrency 1 --num-requests ${N:-20} --no-plots --no-progress --out $OUT/load > $OUT/load.log 2>&1
curl -s http://127.0.0.1:$P/debug/requests > $OUT/traces.json
tail -5 $OUT/load.log
