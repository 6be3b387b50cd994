#!/usr/bin/env bash
# vLLM bf16, the colocated app at main (new) and at d0f7447 (old worktree), W-long, rounds rotated
R=${R:?}; mkdir -p $R
orders=("vllm colocated old" "old vllm colocated" "colocated old vllm")
for r in 1 2 3; do
  for s in ${orders[$((r-1))]}; do
    ray stop --force >/dev/null 2>&1; pkill -9 -f gcs_server; pkill -9 -f raylet; sleep 3
    extra=(); tree=/work/main; srv=$s
    [ $s = vllm ] && extra=(VLLM_ARGS="--dtype bfloat16")
    [ $s = old ] && tree=/work/old && srv=colocated
    out=$R/round-$r; [ $s = old ] && out=$R/old-$r
    (cd $tree && env PEER=/work/peer SERVERS=$srv OUT=$out "${extra[@]}" PEER_SCRIPTS=/work/shared/peer SKIP_FLOOR=1 load_tests/peer_bench.sh W-long > $R/r$r-$s.log 2>&1)
    echo "round $r $s rc=$? $(date +%T)"
    [ $s = old ] && cp $out/colocated_W-long.json $R/round-$r/colocated-old_W-long.json  # renamed afterwards: colocated (d0f7447), colocated-runt (bbcc2e7)
  done
done
