#!/usr/bin/env bash
# two rounds, lanes first: one.sh is ../2026-12-05-one-omp-team/one.sh (run from its scratch copy)
cd /work/scratch/s4
for r in 1 2; do
  for v in lanes default; do
    if [ $v = lanes ]; then C=/work/benchruns/col-lanes; else C=serve_configs; fi
    CFG=$C NAME=ln-$v-$r WL=W-long ./one.sh
  done
done
