#!/usr/bin/env bash
# W-single beside vLLM (bf16): vLLM, the split before d8c350d's idle-core check ("old": the
# measurement patch in this folder's README, SPLITSERVE_IDLE_OLD=1) and at d8c350d ("new"),
# rounds with the order rotated; each side's results land in round-<r>/ as
# vllm_W-single.json, split-old_W-single.json and split_W-single.json.
#   R=<results folder> [ORDERS="vllm old new|..."] [PEER=/work/peer] wsingle_ab.sh
R=${R:?}; mkdir -p $R
IFS='|' read -r -a orders <<< "${ORDERS:-vllm old new|new vllm old|old new vllm}"
for r in $(seq 1 ${#orders[@]}); do
  for s in ${orders[$((r-1))]}; do
    /work/main/.venv/bin/ray stop --force >/dev/null 2>&1; pkill -9 -f gcs_server; pkill -9 -f raylet; sleep 3
    srv=$s; out=$R/round-$r; extra=()
    [ $s = new ] && srv=split
    [ $s = old ] && srv=split && out=$R/old-$r && extra=(SPLITSERVE_IDLE_OLD=1)
    (cd /work/main && env "${extra[@]}" PEER=${PEER:-/work/peer} SERVERS=$srv OUT=$out \
      VLLM_ARGS="--dtype bfloat16" PEER_SCRIPTS=/work/shared/peer SKIP_FLOOR=1 \
      load_tests/peer_bench.sh W-single > $R/r$r-$s.log 2>&1)
    echo "round $r $s rc=$? $(date +%T)"
    [ $s = old ] && mkdir -p $R/round-$r && cp $out/split_W-single.json $R/round-$r/split-old_W-single.json
  done
done
