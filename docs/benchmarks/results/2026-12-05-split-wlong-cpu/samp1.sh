#!/usr/bin/env bash
# one split SmolLM2 W-long run with per-thread CPU sampling
cd /work/scratch/s3
( /work/main/.venv/bin/python /work/scratch/cpuacct.py sample $NAME.jsonl & echo $! > $NAME.sampler )
SERVERS=split WL="W-long" CFG=serve_configs NAME=$NAME ./run1.sh
kill $(cat $NAME.sampler)
