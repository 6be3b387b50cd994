#!/usr/bin/env bash
# Real load-test runs the capacity planner is validated against (issue 8): Poisson arrivals of
# fixed-length requests at three rates, on the split app (serve_configs/local.yaml) or the
# colocated baseline (serve_configs/local-colocated.yaml), one config per call:
#
#   flock /tmp/splitserve-ray-cluster.lock planner/validation_runs.sh local
#   flock /tmp/splitserve-ray-cluster.lock planner/validation_runs.sh local-colocated
#
# then `python -m planner validate --profile ... RESULTS.json --split-config
# serve_configs/local.yaml` (or --colocated-config) replays each run's arrivals through the
# simulator with that config's engine bounds and routing. Knobs (environment): INPUT
# (prompt tokens, 256), OUTPUT (output tokens, 32), RATES ("0.3,0.6,0.9"), N (requests per rate, 30), OUT,
# DTYPE (the profile's engine.dtype, auto: as the serve configs), PROFILE (1:
# first profile the engine passes under the same lock, so the simulator sees the machine as the
# runs do: $OUT/engine-profile.json, for validate --engine-profile). Before the runs, the
# serving stack is timed on the live app ($OUT/stack.json, for validate --stack-split or
# --stack-colocated).
# Starts its own Ray head, so no other Ray may run here; stops everything on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

CFG=${1:?usage: validation_runs.sh local|local-colocated}
INPUT=${INPUT:-256}
OUTPUT=${OUTPUT:-32}
RATES=${RATES:-0.3,0.6,0.9}
N=${N:-30}
OUT=${OUT:-load_tests/results/planner-validation/$CFG}

source load_tests/serve_local.sh

if [ "${PROFILE:-1}" = 1 ]; then
  # the split's passes run on 1 thread, or 2 alone on the machine (prefill_max_threads)
  threads=1,2; [ "$CFG" = local-colocated ] && threads=2
  "$PY" -m planner profile --no-hop --quick --threads "$threads" --dtype "${DTYPE:-auto}" \
    --out "$OUT/engine-profile.json" >"$OUT/engine-profile.log" 2>&1
fi
start_head
serve_config "$CFG"
# the serving stack around the engine, on this app: decode TPOT vs streams, lone-request TTFT
"$PY" -m planner stack --url "$URL" --out "$OUT/stack.json" >"$OUT/stack.log" 2>&1
"$PY" -m load_tests.loadgen --base-url "$URL" --endpoint completions --label "$CFG" \
  --input-len "$INPUT" --output-len "$OUTPUT" --rates "$RATES" --num-requests "$N" \
  --warmup 2 --duration 200 --drain-timeout 120 --slo ttft:2000 tpot:150 --no-progress \
  --no-plots --out "$OUT" | tee "$OUT/loadgen.txt"
