#!/usr/bin/env bash
# split W-long: the parent commit (bench-tree, 81bc8b5) against main (d45d6c1: KV write by runs)
cd /work/scratch/s3
for r in 1 2 3; do
  TREE=/work/main SERVERS=split WL="W-long" NAME=kvw-new-$r ./run1.sh
  TREE=/work/bench-tree SERVERS=split WL="W-long" NAME=kvw-old-$r ./run1.sh
done
echo done > ab4.finished
