#!/usr/bin/env bash
cd /work/scratch/s3
while [ ! -f ab1.finished ]; do sleep 5; done
(cd /work/main && .venv/bin/python /work/scratch/s3/kbench.py 1 8 16 48 128 > /work/scratch/s3/kbench.out 2>&1)
SERVERS=colocated WL="W-long W-mixed" CFG=/work/benchruns/col-c2048 NAME=col-c2048-m ./run1.sh
SERVERS=colocated WL="W-mixed" CFG=/work/benchruns/col-c1024 NAME=col-c1024-m ./run1.sh
SERVERS=colocated WL="W-mixed" CFG=serve_configs NAME=col-c256-m ./run1.sh
SERVERS=vllm WL="W-mixed" NAME=vllm-m ./run1.sh
for r in 1 2; do
  SERVERS=split WL="W-long W-short" CFG=/work/benchruns/split-c1024 NAME=split-c1024-$r ./run1.sh
  SERVERS=split WL="W-long W-short" CFG=serve_configs NAME=split-c256-$r ./run1.sh
done
echo done > ab2.finished
