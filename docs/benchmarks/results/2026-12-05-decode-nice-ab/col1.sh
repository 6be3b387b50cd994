#!/usr/bin/env bash
# one colocated SmolLM2 run of $WL (default W-long)
cd /work/main
O=/work/scratch/s2/${NAME}
rm -rf $O
SERVERS="${SERVERS:-colocated}" OUT=$O VLLM_ARGS="--dtype bfloat16" PEER=/work/peer \
    PEER_SCRIPTS=/work/shared/peer SERVE_CONFIG_DIR=${CFG:-serve_configs} \
    SKIP_FLOOR=1 load_tests/peer_bench.sh ${WL:-W-long} > $O.log 2>&1
