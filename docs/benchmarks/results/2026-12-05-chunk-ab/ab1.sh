#!/usr/bin/env bash
# colocated chunk 256/512/1024, then split base/nolocal; W-single W-short W-long, alternated
cd /work/scratch/s3
for r in 1 2 3; do
  for v in c256 c512 c1024; do
    case $v in c256) C=serve_configs;; *) C=/work/benchruns/col-$v;; esac
    SERVERS=colocated WL="W-single W-short W-long" CFG=$C NAME=col-$v-$r ./run1.sh
  done
done
for r in 1 2 3; do
  for v in base nolocal; do
    case $v in base) C=serve_configs;; *) C=/work/benchruns/smol-$v;; esac
    SERVERS=split WL="W-single W-short W-long" CFG=$C NAME=split-$v-$r ./run1.sh
  done
done
echo done > ab1.finished
