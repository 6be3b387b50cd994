#!/usr/bin/env bash
# after abc: colocated SmolLM2 W-long, base vs nice, alternated
cd /work/scratch/s2
while [ ! -f abc.finished ]; do sleep 5; done
for r in 1 2 3; do
  for v in base nice; do
    case $v in base) C=serve_configs;; nice) C=/work/benchruns/smol-nice;; esac
    CFG=$C NAME=abd-$v-$r ./col1.sh
  done
done
echo done > abd.finished
