#!/usr/bin/env bash
# abstats.sh's served W-long with `perf record -a` over 10 s of the timed run (from 4 s in)
# and the kernel library each replica mapped: abperf.sh OUT "new old ..."
set -u
O=$1; mkdir -p "$O"
i=0
for t in $2; do
  i=$((i+1)); /work/main/.venv/bin/ray stop --force >/dev/null 2>&1; sleep 2
  d=$O/run$i-$t; mkdir -p "$d"
  T=/work/main; [ "$t" = old ] && T=${OLD:?}
  ( cd "$T"; export PY=/work/main/.venv/bin/python BIN=/work/main/.venv/bin PYTHONPATH=$T
    export OUT=$d; source load_tests/serve_local.sh; start_head; OUT=$d serve_config "${CFG:-local-colocated}" || exit 1
    bench() { PEER=${PEER:-/work/peer} SERVED=${SERVED:-smollm2-135m-instruct} /work/shared/peer/bench.sh "$@"; }
    RESULT_DIR=$d/warm bench warm 8000 64 16 8 8 inf --ignore-eos > "$d/warm.log" 2>&1
    RESULT_DIR=$d/warm bench warml 8000 1024 4 2 2 inf --ignore-eos > "$d/warml.log" 2>&1
    SEED=${SEED:-2} RESULT_DIR=$d bench w 8000 "${IL:-1024}" "${OL:-16}" "${N:-16}" "${C:-4}" inf --ignore-eos > "$d/w.log" 2>&1 &
    B=$!; sleep 4
    perf record -a -F 499 -o "$d/perf.data" -- sleep 10 > /dev/null 2>&1
    grep -l splitserve-cpu /proc/[0-9]*/maps 2>/dev/null | while read m; do grep -o "splitserve-cpu-[0-9a-f]*" "$m" | head -1; done | sort | uniq -c > "$d/libs.txt"
    wait $B
    echo "run$i $t $(date +%T) $(grep -E '^(Total token)' "$d/w.log" | awk -F: '{gsub(/ /,"",$2); printf "%s=%s ", substr($1,1,12), $2}') $(cat "$d/libs.txt" | tr '\n' ' ')" )
done
/work/main/.venv/bin/ray stop --force >/dev/null 2>&1
