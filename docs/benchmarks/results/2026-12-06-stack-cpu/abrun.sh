#!/usr/bin/env bash
# Served runs one after another, two sides alternated as given: abrun.sh OUT "a b b a"
#   side a: serve configs from CA (default serve_configs), environment ENV_A ("VAR=value ...")
#   side b: serve configs from CB (default CA), environment ENV_B
#   CFG: the config's name (local-colocated); the client: IL OL N C SEED, PEER, SERVED;
#   THREADS=1: threads.py over 15 s of each run, from TS s after its start.
# The environment reaches the replicas: Ray's workers inherit it from `ray start`.
set -u
O=$1; mkdir -p "$O"; cd /work/main
HERE=$(cd "$(dirname "$0")" && pwd)
i=0
for t in $2; do
  i=$((i+1)); /work/main/.venv/bin/ray stop --force >/dev/null 2>&1; sleep 2
  d=$O/run$i-$t; mkdir -p "$d"
  if [ "$t" = a ]; then D=${CA:-serve_configs}; E=${ENV_A:-}; else D=${CB:-${CA:-serve_configs}}; E=${ENV_B:-}; fi
  ( for kv in $E; do export "$kv"; done
    export OUT=$d; source load_tests/serve_local.sh; start_head
    SERVE_CONFIG_DIR=$D OUT=$d serve_config "${CFG:-local-colocated}" || exit 1
    bench() { PEER=${PEER:-/work/peer} SERVED=${SERVED:-smollm2-135m-instruct} /work/shared/peer/bench.sh "$@"; }
    RESULT_DIR=$d/warm bench warm 8000 64 16 8 8 inf --ignore-eos > "$d/warm.log" 2>&1
    SEED=${SEED:-0} RESULT_DIR=$d bench w 8000 "${IL:-64}" "${OL:-64}" "${N:-128}" "${C:-8}" inf \
      --ignore-eos > "$d/w.log" 2>&1 &
    B=$!
    if [ "${THREADS:-0}" = 1 ]; then sleep "${TS:-6}"; python3 "$HERE/threads.py" 15 > "$d/threads.txt"; fi
    wait $B
    echo "run$i $t $(date +%T) $(grep -E '^(Output token|Total token|Median TTFT|Median TPOT|P99 ITL)' "$d/w.log" \
      | awk -F: '{gsub(/ /,"",$2); printf "%s=%s ", substr($1,1,12), $2}')" )
done
/work/main/.venv/bin/ray stop --force >/dev/null 2>&1
