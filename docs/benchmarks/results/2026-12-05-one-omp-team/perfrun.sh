#!/usr/bin/env bash
# one colocated W-long run (bench-tree) with `perf record` on the replica for 10 s mid-run
cd /work/bench-tree
O=/work/scratch/s4/perf-wlong; rm -rf $O $O.data
pkill -9 -f gcs_server; pkill -9 -f raylet; pkill -9 -f "ray::"; sleep 2
(
  while [ ! -f $O/logs/colocated_W-long.log ]; do sleep 0.5; done
  sleep 4
  P=$(pgrep -f "ServeReplica:colocated:ColocatedServer" | head -1)
  perf record -F 999 -g -p $P -o $O.data -- sleep 10 > $O.perf.log 2>&1
) &
SERVERS=colocated OUT=$O VLLM_ARGS="--dtype bfloat16" PEER=/work/peer PEER_SCRIPTS=/work/shared/peer \
  SKIP_FLOOR=1 load_tests/peer_bench.sh W-long > $O.log 2>&1
wait
python3 -c "import json;d=json.load(open('$O/colocated_W-long.json'));print(round(d['total_input_tokens']/d['duration']))"
