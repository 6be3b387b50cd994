#!/usr/bin/env bash
# one SmolLM2 run from the bench worktree: SERVERS, WL, CFG, NAME
cd ${TREE:-/work/bench-tree}
O=/work/scratch/s3/${NAME}
rm -rf $O
SERVERS="${SERVERS:-colocated}" OUT=$O VLLM_ARGS="--dtype bfloat16" PEER=/work/peer \
    PEER_SCRIPTS=/work/shared/peer SERVE_CONFIG_DIR=${CFG:-serve_configs} \
    SKIP_FLOOR=1 load_tests/peer_bench.sh ${WL:-W-long} > $O.log 2>&1
