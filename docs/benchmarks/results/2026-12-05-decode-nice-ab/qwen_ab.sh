#!/usr/bin/env bash
# Qwen split W-short, the committed configs with decode at -10 (dn) against a variant config
# folder B (label L), alternated, ROUNDS rounds. As run here:
#   abg: L=pn B=<configs + prefill: nice: -5> ROUNDS="1 2"
#   abh: L=nl B=<configs + local_prefill_when_busy: 0> ROUNDS="1 2", then ROUNDS="3 4"
cd /work/scratch/s2
for r in ${ROUNDS:-1 2}; do
  for v in dn "$L"; do
    case $v in dn) C=/work/benchruns/qwen-configs-nice;; *) C=$B;; esac
    SAMPLE=0 CFG=$C NAME=$SET-$v-$r ./split1.sh
  done
done
