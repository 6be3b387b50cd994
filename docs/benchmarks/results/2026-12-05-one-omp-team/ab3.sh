#!/usr/bin/env bash
# alternated: base (two pools), onepool (default spin), spin10k (one pool, GOMP_SPINCOUNT=10000)
cd /work/scratch/s4
for r in 3 4 5; do
  for v in onepool base; do
    case $v in
      base) export XP_ONEPOOL=0; unset GOMP_SPINCOUNT ;;
      onepool) export XP_ONEPOOL=1; unset GOMP_SPINCOUNT ;;
      spin10k) export XP_ONEPOOL=1; export GOMP_SPINCOUNT=10000 ;;
    esac
    NAME=ab2-$v-$r WL="W-single W-short W-long" ./one.sh
  done
done
