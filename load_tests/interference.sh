#!/usr/bin/env bash
# Experiment 1 of issue 5, interference: steady decode streams (64-token prompts, 256-token
# outputs) while 1024-token prompts arrive. For the split app (serve_configs/local.yaml) and
# the colocated baseline (serve_configs/local-colocated.yaml), one after the other on a local Ray
# head: decode-class TPOT/ITL with the long prompts arriving, against the same streams
# undisturbed.
#
#   flock /tmp/splitserve-ray-cluster.lock load_tests/interference.sh
#
# Knobs (environment): STREAMS (concurrent decode streams, 4; each run sends two rounds),
# DOC_RATE (long prompts/s, 0.2), DOC_OUTPUT (their output tokens, 16; 1 keeps them out of
# the decode batch), MAX_DOCS (bound on long prompts, 100), CONFIGS ("local
# local-colocated"), OUT.
# Starts its own Ray head, so no other Ray may run here; stops everything on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

STREAMS=${STREAMS:-4}
DOC_RATE=${DOC_RATE:-0.2}
MAX_DOCS=${MAX_DOCS:-100}
DOC_OUTPUT=${DOC_OUTPUT:-16}
CONFIGS=${CONFIGS:-"local local-colocated"}
OUT=${OUT:-load_tests/results/interference-$(date +%Y%m%d-%H%M%S)}

source load_tests/serve_local.sh
start_head

DECODE="name=decode,input=64,output=256,concurrency=$STREAMS"
for cfg in $CONFIGS; do
  echo "== $cfg"
  serve_config "$cfg"
  # undisturbed: two rounds of the decode streams, nothing else
  "$PY" -m load_tests.loadgen --base-url "$URL" --endpoint completions --label "$cfg" \
    --class "$DECODE,n=$((2 * STREAMS))" --warmup 1 --duration 300 --no-progress \
    --out "$OUT/$cfg-undisturbed" | tee "$OUT/$cfg-undisturbed.txt"
  # loaded: the same streams while long prompts keep arriving at DOC_RATE, until the last
  # stream ends (docs are the background class: they stop once the decode streams are done)
  "$PY" -m load_tests.loadgen --base-url "$URL" --endpoint completions --label "$cfg" \
    --class "$DECODE,n=$((2 * STREAMS))" \
    --class "name=docs,input=1024,output=$DOC_OUTPUT,rate=$DOC_RATE,n=$MAX_DOCS,background=1" \
    --duration 300 --no-progress \
    --out "$OUT/$cfg-loaded" | tee "$OUT/$cfg-loaded.txt"
  serve_shutdown
done

args=()
for cfg in $CONFIGS; do
  args+=("$cfg undisturbed=$OUT/$cfg-undisturbed" "$cfg loaded=$OUT/$cfg-loaded")
done
{
  echo "decode class"
  "$PY" -m load_tests.compare --class decode "${args[@]}"
  echo
  echo "docs class"
  "$PY" -m load_tests.compare --class docs "${args[@]}"
} | tee "$OUT/summary.md"
"$PY" -m load_tests.plots --class decode --out "$OUT/decode_latency_cdf.png" "${args[@]}"
echo "results in $OUT"
