#!/bin/bash
# OUT=<results folder> ORDER="A B B A" A=<serve-config folder> B=<serve-config folder> ./run.sh
# (run from anywhere; each named side's folder holds a local.yaml, or CFG=<name>.yaml)
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../../.." || exit 1
export OUT=${OUT:?OUT: a folder for the results}
mkdir -p "$OUT"
source load_tests/serve_local.sh
start_head || exit 1
i=0
for side in $ORDER; do
  i=$((i+1))
  SERVE_CONFIG_DIR=${!side} serve_config ${CFG:-local} || exit 1
  .venv/bin/python "$HERE/client.py" http://127.0.0.1:8000 ${N:-6} ${TOK:-128} > $OUT/client-$i-$side.txt
  .venv/bin/python -c "
import ray; from ray import serve
ray.init(address='auto', logging_level='ERROR')
h = serve.get_deployment_handle('DecodeServer', app_name='splitserve')
s = h.stats.remote().result(); print('mean_step_ms', round(1000*s['mean_step_s'],2), 'fp', s['fingerprint'])" > $OUT/stats-$i-$side.txt 2>&1
  serve_shutdown
  echo "$i $side $(tail -1 $OUT/client-$i-$side.txt) $(cat $OUT/stats-$i-$side.txt | tail -1)"
done
