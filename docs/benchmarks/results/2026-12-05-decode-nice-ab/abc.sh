#!/usr/bin/env bash
cd /work/scratch/s2
for r in 1 2 3; do
  for v in base nice; do
    case $v in base) C=/work/benchruns/qwen-configs;; nice) C=/work/benchruns/qwen-nice;; esac
    SAMPLE=0 CFG=$C NAME=abc-$v-$r ./split1.sh
  done
done
echo done > abc.finished
