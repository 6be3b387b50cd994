#!/bin/bash
# the session's commits (NEW, /work/main at 35de351) against the session's start (OLD, 963c05c), alternated
declare -A T=([old]=/work/bench-tree [new]=/work/main)
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for v in $order; do echo "r$r $v colocated $(/work/scratch/s7/ab_run.sh ${T[$v]} local-colocated col-$v-$r W-long 2>&1 | tail -1)"; done
  for v in $order; do echo "r$r $v split $(/work/scratch/s7/ab_run.sh ${T[$v]} local split-$v-$r W-long 2>&1 | tail -1)"; done
done
