#!/usr/bin/env bash
# Structured outputs side by side: vLLM-CPU and this app's split deployment, one after the
# other, ROUNDS rounds with the order rotated, each serving load_tests/structured_peer.py's
# requests (a mid-size JSON schema, sampled). Results: $OUT/<round>-<server>.json.
#   OUT=<folder> PEER=<peer setup folder> [ROUNDS=2] [VLLM_ARGS="--dtype bfloat16"] \
#     [PEER_SCRIPTS=<folder with start_vllm.sh>] load_tests/structured_peer.sh
# The peer (vLLM's CPU build) is set up by PEER_SCRIPTS/setup.sh (see BENCHMARKS.md §7).
set -euo pipefail
: "${OUT:?set OUT}" "${PEER:?set PEER (the peer setup folder)}"
PEER_SCRIPTS=${PEER_SCRIPTS:-$PWD/../shared/peer}
ROUNDS=${ROUNDS:-2}
VLLM_PORT=${VLLM_PORT:-8101}
# shellcheck source=load_tests/serve_local.sh
source load_tests/serve_local.sh
mkdir -p "$OUT/logs"

run_vllm() {  # run_vllm ROUND
  rm -f "$PEER/vllm.pid"
  # shellcheck disable=SC2086
  PEER=$PEER setsid "$PEER_SCRIPTS/start_vllm.sh" --port "$VLLM_PORT" ${VLLM_ARGS:-} \
    >"$OUT/logs/vllm-$1.log" 2>&1 &
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$VLLM_PORT/v1/models" >/dev/null 2>&1 && break
    sleep 2
  done
  "$PY" -m load_tests.structured_peer --url "http://127.0.0.1:$VLLM_PORT" --model smollm2 \
    --json "$OUT/$1-vllm.json"
  kill -TERM -- "-$(cat "$PEER/vllm.pid")" 2>/dev/null || true
  sleep 5
}

run_app() {  # run_app ROUND
  start_head
  serve_config local
  "$PY" -m load_tests.structured_peer --url "$URL" --model smollm2-135m-instruct \
    --json "$OUT/$1-split.json"
  cleanup
}

for r in $(seq "$ROUNDS"); do
  if (( r % 2 )); then run_vllm "$r"; run_app "$r"; else run_app "$r"; run_vllm "$r"; fi
done
{ date -u +%FT%TZ; git rev-parse --short HEAD; lscpu | grep -E "Model name|^CPU\(s\)"; } \
  > "$OUT/run-info.txt"
