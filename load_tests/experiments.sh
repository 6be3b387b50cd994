#!/usr/bin/env bash
# Experiments 2-4 of issue 5, split (serve_configs/local.yaml) against colocated
# (serve_configs/local-colocated.yaml) at equal cores, one after the other on a local Ray head:
#
#   2. goodput vs request rate on a mixed workload (chats: 64-token prompts, 128-token
#      outputs; documents: 1024-token prompts, 16-token outputs; 3:1 by count, Poisson) under
#      TTFT and TPOT targets for this CPU;
#   3. where split loses: short prompts only (64 in / 64 out) at a low rate;
#   4. every run records the server's own per-request timings (--server-timings: prefill
#      queue and compute, KV hop, decode queue, decode), reported per class.
#
#   flock /tmp/splitserve-ray-cluster.lock load_tests/experiments.sh
#
# Knobs (environment): RATES ("0.2,0.4,0.6,0.8"), DURATION (seconds of arrivals per rate,
# 100), SLO ("ttft:8000 tpot:200"), SHORT_RATE (0.5), SHORT_N (30), CONFIGS ("local
# local-colocated"), OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

RATES=${RATES:-0.2,0.4,0.6,0.8}
DURATION=${DURATION:-100}
SLO=${SLO:-"ttft:8000 tpot:200"}
SHORT_RATE=${SHORT_RATE:-0.5}
SHORT_N=${SHORT_N:-30}
CONFIGS=${CONFIGS:-"local local-colocated"}
OUT=${OUT:-load_tests/results/experiments-$(date +%Y%m%d-%H%M%S)}

source load_tests/serve_local.sh
start_head

# shellcheck disable=SC2086  # SLO is a list of NAME:MS words
for cfg in $CONFIGS; do
  echo "== $cfg"
  serve_config "$cfg"
  "$PY" -m load_tests.loadgen --base-url "$URL" --endpoint completions --label "$cfg" \
    --class name=chat,input=64,output=128,weight=3 \
    --class name=docs,input=1024,output=16,weight=1 \
    --rates "$RATES" --num-requests 1000 --duration "$DURATION" --drain-timeout 120 \
    --warmup 2 --slo $SLO --server-timings --no-progress \
    --out "$OUT/$cfg-mixed" | tee "$OUT/$cfg-mixed.txt"
  "$PY" -m load_tests.loadgen --base-url "$URL" --endpoint completions --label "$cfg" \
    --input-len 64 --output-len 64 --rate "$SHORT_RATE" --num-requests "$SHORT_N" \
    --duration 300 --warmup 1 --slo $SLO --server-timings --no-progress \
    --out "$OUT/$cfg-short" | tee "$OUT/$cfg-short.txt"
  serve_shutdown
done

mixed=() short=()
for cfg in $CONFIGS; do
  mixed+=("$cfg=$OUT/$cfg-mixed")
  short+=("$cfg=$OUT/$cfg-short")
done
{
  echo "mixed workload, all requests"
  "$PY" -m load_tests.compare "${mixed[@]}"
  for cls in chat docs; do
    echo; echo "mixed workload, $cls"
    "$PY" -m load_tests.compare --class "$cls" "${mixed[@]}"
  done
  echo; echo "short prompts, low load"
  "$PY" -m load_tests.compare "${short[@]}"
} | tee "$OUT/summary.md"
"$PY" -m load_tests.plots --goodput --out "$OUT/goodput_vs_rate.png" "${mixed[@]}"
echo "results in $OUT"
