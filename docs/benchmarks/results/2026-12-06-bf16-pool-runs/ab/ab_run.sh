#!/bin/bash
# ab_run.sh TREE CONFIG OUTNAME WL...: serve CONFIG from TREE, warm up, run the workloads
cd $1; CFG=$2; O=/work/scratch/s7/ab/$3; shift 3
pkill -9 -f gcs_server; pkill -9 -f raylet; pkill -9 -f "ray::"; sleep 2
rm -rf $O; mkdir -p $O; OUT=$O
source load_tests/serve_local.sh
start_head; serve_config $CFG || exit 1
B() { PEER=/work/peer SERVED=smollm2-135m-instruct SEED=$7 RESULT_DIR=$O /work/shared/peer/bench.sh $1 8000 $2 $3 $4 $5 $6 --ignore-eos > $O/$1.log 2>&1; }
B warm1 64 16 8 8 inf 9; B warm2 1024 4 2 2 inf 9
for wl in "$@"; do
  case $wl in
   W-short) B W-short 64 64 64 8 inf 1;;
   W-long) B W-long 1024 16 16 4 inf 2;;
  esac
  python3 -c "import json;d=json.load(open('$O/$wl.json'));print('$wl', round(d['total_input_tokens']/d['duration']), round(d['output_throughput'],1), 'ttft', round(d['median_ttft_ms']), 'tpot', round(d['median_tpot_ms'],1))"
done
