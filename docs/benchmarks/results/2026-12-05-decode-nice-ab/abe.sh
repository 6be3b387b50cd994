#!/usr/bin/env bash
# after abd: split SmolLM2 W-single W-short W-long, base vs nice, alternated
cd /work/scratch/s2
while [ ! -f abd.finished ]; do sleep 5; done
for r in 1 2; do
  for v in nice base; do
    case $v in base) C=serve_configs;; nice) C=/work/benchruns/smol-nice;; esac
    SERVERS=split WL="W-single W-short W-long" CFG=$C NAME=abe-$v-$r ./col1.sh
  done
done
echo done > abe.finished
