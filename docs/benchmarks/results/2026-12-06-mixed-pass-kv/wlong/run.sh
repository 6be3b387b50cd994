#!/usr/bin/env bash
# W-long beside vLLM (bf16): the colocated app at main (colocated) and at 12610de (old: a
# worktree at /work/old-tree sharing main's .venv), three rounds, the order rotated.
#   R=<results folder> docs/benchmarks/results/2026-12-06-mixed-pass-kv/wlong/run.sh
R=${R:?}; mkdir -p $R
orders=("vllm colocated old" "old vllm colocated" "colocated old vllm")
for r in 1 2 3; do
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
