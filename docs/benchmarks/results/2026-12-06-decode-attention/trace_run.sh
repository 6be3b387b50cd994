#!/bin/bash
# one server config, warm-up, workload(s), dump /debug/requests after each
# usage: PEER=<vllm folder> PEER_SCRIPTS=<peer scripts> trace_run.sh TREE CONFIG OUTDIR WL...
# (TREE: a checkout to serve; OUTDIR: an absolute path; NOSAMPLE=1: no per-thread CPU sampling)
cd $1; CFG=$2; O=$3; shift 3
pkill -9 -f gcs_server; pkill -9 -f raylet; pkill -9 -f "ray::"; sleep 2
rm -rf $O; mkdir -p $O; OUT=$O
source load_tests/serve_local.sh
start_head; serve_config $CFG || exit 1
B() { PEER=$PEER SERVED=${SERVED:-smollm2-135m-instruct} SEED=$7 RESULT_DIR=$O $PEER_SCRIPTS/bench.sh $1 8000 $2 $3 $4 $5 $6 --ignore-eos > $O/$1.log 2>&1; }
B warm1 64 16 8 8 inf 9; B warm2 1024 4 2 2 inf 9
for wl in "$@"; do
  [ -z "$NOSAMPLE" ] && { python3 "$(dirname "$0")/../2026-12-05-split-wlong-cpu/cpuacct.py" sample $O/$wl.cpu & SP=$!; }
  case $wl in
   W-short) B W-short 64 64 64 8 inf 1;;
   W-long) B W-long 1024 16 16 4 inf 2;;
   W-single) B W-single 64 64 8 1 inf 5;;
  esac
  [ -z "$NOSAMPLE" ] && kill $SP
  curl -s "127.0.0.1:8000/debug/requests?limit=64" > $O/$wl-trace.json
  python3 -c "import json;d=json.load(open('$O/$wl.json'));print('$wl', round(d['total_input_tokens']/d['duration']), round(d['output_throughput'],1), 'ttft', round(d['median_ttft_ms']), 'tpot', round(d['median_tpot_ms'],1), 'itl99', round(d['p99_itl_ms']))"
done
