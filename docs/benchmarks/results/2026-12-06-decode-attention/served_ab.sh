#!/bin/bash
# served A/B of the decode attention: OLD tree (081d843) vs NEW (c5dc717), order alternated
# OLD, NEW: checkouts at 081d843 and c5dc717; RUNS: an absolute folder for the runs
export NOSAMPLE=1
declare -A T=([old]=$OLD [new]=$NEW)
for r in 1 2; do
  if [ $((r % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for v in $order; do echo "r$r $v split $("$(dirname "$0")"/trace_run.sh ${T[$v]} local $RUNS/sab-split-$v-$r W-short W-long 2>&1 | tail -2 | tr '\n' ' ')"; done
  for v in $order; do echo "r$r $v colocated $("$(dirname "$0")"/trace_run.sh ${T[$v]} local-colocated $RUNS/sab-col-$v-$r W-long 2>&1 | tail -1)"; done
done
