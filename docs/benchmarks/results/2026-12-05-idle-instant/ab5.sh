#!/usr/bin/env bash
# split W-single W-short W-long: bench-tree (e36eb70) against main (idle cores at this instant)
cd /work/scratch/s3
for r in 1 2; do
  TREE=/work/main SERVERS=split WL="W-single W-short W-long" NAME=idl-new-$r ./run1.sh
  TREE=/work/bench-tree SERVERS=split WL="W-single W-short W-long" NAME=idl-old-$r ./run1.sh
done
echo done > ab5.finished
