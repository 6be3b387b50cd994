#!/usr/bin/env bash
# one colocated run of $WL from $TREE with the schedstat sampler; NAME
cd ${TREE:-/work/bench-tree}
O=/work/scratch/s4/$NAME; rm -rf $O
pkill -9 -f gcs_server; pkill -9 -f raylet; pkill -9 -f "ray::"; sleep 2
python3 /work/scratch/s4/ss.py sample $O.ss &
SP=$!
SERVERS=${SERVERS:-colocated} OUT=$O VLLM_ARGS="--dtype bfloat16" PEER=/work/peer PEER_SCRIPTS=/work/shared/peer \
  SERVE_CONFIG_DIR=${CFG:-serve_configs} SKIP_FLOOR=1 load_tests/peer_bench.sh ${WL:-W-long} > $O.log 2>&1
kill $SP
for f in $O/*_W-*.json; do python3 -c "import json,sys;d=json.load(open('$f'));print('$NAME', d['label'], round(d['total_input_tokens']/d['duration']), round(d['output_throughput'],1), 'ttft', round(d['median_ttft_ms']), 'tpot', round(d['median_tpot_ms'],1), 'itl99', round(d['p99_itl_ms']))"; done
