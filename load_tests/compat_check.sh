#!/usr/bin/env bash
# Issue 15's "done when", against the app as `make run` serves it (serve_configs/local.yaml):
# vLLM's own client (`vllm bench serve`) with its completions and chat back-ends, then the
# official openai client with every neutral field (load_tests/client_compat.py).
#
#   flock /tmp/splitserve-ray-cluster.lock env PEER=<vLLM scratch folder> load_tests/compat_check.sh
#
# PEER: a folder set up by the peer's setup.sh (vllm-venv/, smollm2-hf/), outside the checkout.
# Starts its own Ray head (load_tests/serve_local.sh), so no other Ray may run here. Prints
# each client's outcome; exits non-zero if any failed. Logs go to OUT (load_tests/results/...).
set -uo pipefail
cd "$(dirname "$0")/.."
P=${PEER:?set PEER to the vLLM scratch folder}
OUT=${OUT:-load_tests/results/compat-$(date +%Y%m%d-%H%M%S)}
source load_tests/serve_local.sh
start_head
serve_config local || exit 1
common=(--base-url "$URL" --model "$P/smollm2-hf" --served-model-name smollm2-135m-instruct
  --tokenizer "$P/smollm2-hf" --dataset-name random --random-input-len 64
  --random-output-len 16 --random-range-ratio 0 --num-prompts 8 --max-concurrency 4
  --temperature 0 --seed 1 --ignore-eos)
status=0
for backend in "openai /v1/completions" "openai-chat /v1/chat/completions"; do
  set -- $backend
  HF_HUB_OFFLINE=1 "$P/vllm-venv/bin/vllm" bench serve --backend "$1" --endpoint "$2" \
    "${common[@]}" >"$OUT/bench-$1.log" 2>&1
  rc=$?
  ok=$(grep -E "Successful requests" "$OUT/bench-$1.log" | tr -s ' ')
  failed=$(grep -E "Failed requests" "$OUT/bench-$1.log" | tr -s ' ')
  echo "vllm bench serve --backend $1: rc=$rc; $ok; $failed"
  [ "$rc" = 0 ] && grep -qE "Failed requests: +0" "$OUT/bench-$1.log" || status=1
done
"$PY" -m load_tests.client_compat --base-url "$URL/v1" >"$OUT/client.log" 2>&1
rc=$?
echo "openai client (load_tests/client_compat.py): rc=$rc; $(tail -1 "$OUT/client.log")"
[ "$rc" = 0 ] || status=1
exit $status
