#!/usr/bin/env bash
# alternated: base (two pools), onepool (default spin), spin10k (one pool, GOMP_SPINCOUNT=10000)
# as run: rounds 1-2 with the defaults (stopped after onepool-2, so spin10k ran once), then
# rounds 3-5 as ROUNDS="3 4 5" VARIANTS="onepool base" ab2.sh
cd /work/scratch/s4
for r in ${ROUNDS:-1 2 3}; do
  for v in ${VARIANTS:-base onepool spin10k}; do
    case $v in
      base) export XP_ONEPOOL=0; unset GOMP_SPINCOUNT ;;
      onepool) export XP_ONEPOOL=1; unset GOMP_SPINCOUNT ;;
      spin10k) export XP_ONEPOOL=1; export GOMP_SPINCOUNT=10000 ;;
    esac
    NAME=ab2-$v-$r WL="W-single W-short W-long" ./one.sh
  done
done
