#!/usr/bin/env bash
cd /work/scratch/s3
for r in 2 3; do
  SERVERS=colocated WL="W-mixed" CFG=/work/benchruns/col-c1024 NAME=col-c1024-m$r ./run1.sh
  SERVERS=colocated WL="W-mixed" CFG=serve_configs NAME=col-c256-m$r ./run1.sh
done
echo done > ab3.finished
