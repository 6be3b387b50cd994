#!/usr/bin/env bash
# W-long beside vLLM (bf16): the colocated app at main (colocated) and at an earlier commit
# (old: a worktree at /work/old-tree sharing main's .venv; ecf611e for this folder, 12610de
# for 2026-12-06-mixed-pass-kv/wlong), three rounds, the order rotated. ORDERS: other
# rounds, `|` between them (2026-12-06-mixed-pass-kv/wlong2: "vllm colocated|colocated
# vllm|vllm colocated").
#   R=<results folder> [ORDERS=...] docs/benchmarks/results/2026-12-06-attention-softmax/wlong/run.sh
R=${R:?}; mkdir -p $R
IFS='|' read -r -a orders <<< "${ORDERS:-vllm colocated old|old vllm colocated|colocated old vllm}"
for r in $(seq 1 ${#orders[@]}); do
  for s in ${orders[$((r-1))]}; do
    /work/main/.venv/bin/ray stop --force >/dev/null 2>&1; pkill -9 -f gcs_server; pkill -9 -f raylet; sleep 3
    extra=(); tree=/work/main; srv=$s
    [ $s = vllm ] && extra=(VLLM_ARGS="--dtype bfloat16")
    [ $s = old ] && tree=/work/old-tree && srv=colocated
    out=$R/round-$r; [ $s = old ] && out=$R/old-$r
    (cd $tree && env PEER=/work/peer SERVERS=$srv OUT=$out "${extra[@]}" PEER_SCRIPTS=/work/shared/peer SKIP_FLOOR=1 load_tests/peer_bench.sh W-long > $R/r$r-$s.log 2>&1)
    echo "round $r $s rc=$? $(date +%T)"
    [ $s = old ] && mkdir -p $R/round-$r && cp $out/colocated_W-long.json $R/round-$r/colocated-old_W-long.json
  done
done
