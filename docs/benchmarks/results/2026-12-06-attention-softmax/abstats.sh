#!/usr/bin/env bash
# Served W-long, two trees alternated, with the replica's pass totals: abstats.sh OUT "new old ..."
#   new: /work/main; old: $OLD (a worktree sharing main's .venv); mid: $MID. The colocated app
#   (CFG), the peer's bench client (IL OL N C SEED: W-long), the replica's stats() read before
#   and after the timed run (stats-before.json, stats-after.json). PERF=1: also `perf record -a`
#   over 10 s (PERF_S) of the timed run from 4 s in (perf.data; PERF_OPTS: its options) and the kernel library each process
#   mapped (libs.txt).
set -u
O=$1; mkdir -p "$O"
i=0
for t in $2; do
  i=$((i+1)); /work/main/.venv/bin/ray stop --force >/dev/null 2>&1; sleep 2
  d=$O/run$i-$t; mkdir -p "$d"
  T=/work/main; [ "$t" = old ] && T=${OLD:?}; [ "$t" = mid ] && T=${MID:?}
  ( cd "$T"; export PY=/work/main/.venv/bin/python BIN=/work/main/.venv/bin PYTHONPATH=$T
    export OUT=$d; source load_tests/serve_local.sh; start_head; OUT=$d serve_config "${CFG:-local-colocated}" || exit 1
    bench() { PEER=${PEER:-/work/peer} SERVED=${SERVED:-smollm2-135m-instruct} /work/shared/peer/bench.sh "$@"; }
    RESULT_DIR=$d/warm bench warm 8000 64 16 8 8 inf --ignore-eos > "$d/warm.log" 2>&1
    RESULT_DIR=$d/warm bench warml 8000 1024 4 2 2 inf --ignore-eos > "$d/warml.log" 2>&1
    stats() { $PY -c "import json, ray; from ray import serve; ray.init(address='auto', logging_level='ERROR')
print(json.dumps(serve.get_deployment_handle('ColocatedServer', 'colocated').stats.remote().result()))" 2>/dev/null; }
    stats > "$d/stats-before.json"
    SEED=${SEED:-2} RESULT_DIR=$d bench w 8000 "${IL:-1024}" "${OL:-16}" "${N:-16}" "${C:-4}" inf --ignore-eos > "$d/w.log" 2>&1 &
    B=$!
    if [ "${PERF:-0}" = 1 ]; then
      sleep ${PERF_AT:-4}; perf record -a ${PERF_OPTS:--F 499} -o "$d/perf.data" -- sleep ${PERF_S:-10} > /dev/null 2>&1
      grep -l splitserve-cpu /proc/[0-9]*/maps 2>/dev/null | while read -r m; do
        grep -o "splitserve-cpu-[0-9a-f]*" "$m" | head -1; done | sort | uniq -c > "$d/libs.txt"
    fi
    wait $B
    stats > "$d/stats-after.json"
    echo "run$i $t $(date +%T) $(grep -E '^(Total token|Median TTFT|Median TPOT|Benchmark duration)' "$d/w.log" \
      | awk -F: '{gsub(/ /,"",$2); printf "%s=%s ", substr($1,1,12), $2}') $(python3 -c "
import json; a=json.load(open('$d/stats-before.json')); b=json.load(open('$d/stats-after.json'))
f=lambda s,k: s[k]
print('compute_s=%.2f passes=%d' % (f(b,'prefill_compute_s_total')-f(a,'prefill_compute_s_total'), f(b,'prefill_passes')-f(a,'prefill_passes')))" 2>&1)" )
done
/work/main/.venv/bin/ray stop --force >/dev/null 2>&1
