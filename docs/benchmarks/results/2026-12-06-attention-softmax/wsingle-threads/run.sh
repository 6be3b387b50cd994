#!/usr/bin/env bash
# W-single (64 in / 64 out, one at a time, 16 requests) on the colocated app: bf16 and int8
# weights, the replica's passes on 2 or 1 threads (configs: serve_configs/local-colocated.yaml
# with `weights: int8` and/or `colocated.num_threads: 1` in /work/cfg-*), three rotated rounds,
# each run through ../../2026-12-06-stack-cpu/abrun.sh.
R=${R:?}; S=/work/main/docs/benchmarks/results/2026-12-06-stack-cpu/abrun.sh
orders=("bf-t2 i8-t2 i8-t1 bf-t1" "i8-t1 bf-t1 bf-t2 i8-t2" "i8-t2 bf-t2 bf-t1 i8-t1")
for r in 1 2 3; do
  for c in ${orders[$((r-1))]}; do
    dir=/work/cfg-$c; [ $c = bf-t2 ] && dir=/work/main/serve_configs
    CA=$dir IL=64 OL=64 N=16 C=1 SEED=5 $S $R/r$r-$c "a" | sed "s/^run1 a/r$r $c/"
  done
done
