#!/usr/bin/env bash
# Qwen split W-short: decode -10 (committed) vs decode -10 + prefill -5, alternated
cd /work/scratch/s2
for r in 1 2; do
  for v in dn pn; do
    case $v in dn) C=/work/benchruns/qwen-configs-nice;; pn) C=/work/benchruns/qwen-pnice;; esac
    SAMPLE=0 CFG=$C NAME=abg-$v-$r ./split1.sh
  done
done
echo done > abg.finished
