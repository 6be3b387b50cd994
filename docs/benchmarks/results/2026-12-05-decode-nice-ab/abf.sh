#!/usr/bin/env bash
# after the Qwen rounds: split SmolLM2 W-long, nice vs base, alternated
cd /work/scratch/s2
while [ ! -f /work/main/docs/benchmarks/results/2026-12-05-qwen-decode-nice/finished ]; do sleep 5; done
for r in 1 2; do
  for v in base nice; do
    case $v in base) C=/work/benchruns/smol-base;; nice) C=/work/main/serve_configs;; esac
    SERVERS=split WL="W-long" CFG=$C NAME=abf-$v-$r ./col1.sh
  done
done
echo done > abf.finished
