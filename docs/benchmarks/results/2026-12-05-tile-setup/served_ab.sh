#!/bin/bash
# served A/B: split W-short old vs new; colocated W-long new vs guided; ROUNDS rounds, order alternated
declare -A TREE=([old]=/work/bench-old [new]=/work/bench-tree [guided]=/work/bench-guided)
one() { # server workload variant round
  local s=$1 wl=$2 v=$3 r=$4
  local O=/work/scratch/s5/sab/$s-$wl-$v-$r; rm -rf $O; mkdir -p /work/scratch/s5/sab
  pkill -9 -f gcs_server; pkill -9 -f raylet; pkill -9 -f "ray::"; sleep 3
  (cd ${TREE[$v]} && SERVERS=$s OUT=$O VLLM_ARGS="--dtype bfloat16" PEER=/work/peer PEER_SCRIPTS=/work/shared/peer \
    SKIP_FLOOR=1 load_tests/peer_bench.sh $wl > $O.log 2>&1)
  for f in $O/*_W-*.json; do python3 -c "import json;d=json.load(open('$f'));print('$s $wl $v $r', round(d['total_input_tokens']/d['duration']), round(d['output_throughput'],1), 'ttft', round(d['median_ttft_ms']), 'tpot', round(d['median_tpot_ms'],1), 'itl99', round(d['p99_itl_ms']))"; done
}
for r in $(seq ${ROUNDS:-2}); do
  if [ $((r % 2)) = 1 ]; then a=old; b=new; c=new; d=guided; else a=new; b=old; c=guided; d=new; fi
  one split W-short $a $r; one split W-short $b $r
  one colocated W-long $c $r; one colocated W-long $d $r
done
