#!/usr/bin/env bash
# Qwen split W-short: decode -10 (committed) vs the same with local_prefill_when_busy: 0, alternated
cd /work/scratch/s2
for r in 3 4; do
  for v in dn nl; do
    case $v in dn) C=/work/benchruns/qwen-configs-nice;; nl) C=/work/benchruns/qwen-nolocal;; esac
    SAMPLE=0 CFG=$C NAME=abh-$v-$r ./split1.sh
  done
done
echo done > abh2.finished
