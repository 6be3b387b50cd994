#!/bin/bash
# GOMP_SPINCOUNT=10000 against libgomp's default for the colocated app (NEW: a checkout at 9ff6856; RUNS: an absolute folder); stopped after two rounds
export NOSAMPLE=1
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then order="base s10k"; else order="s10k base"; fi
  for v in $order; do
    unset GOMP_SPINCOUNT; [ $v = s10k ] && export GOMP_SPINCOUNT=10000
    echo "r$r $v $("$(dirname "$0")"/trace_run.sh $NEW local-colocated $RUNS/spin2-$v-$r W-long W-single 2>&1 | tail -2 | tr '\n' ' ')"
  done
done
