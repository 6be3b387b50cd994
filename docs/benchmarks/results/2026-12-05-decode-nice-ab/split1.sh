#!/usr/bin/env bash
# one split Qwen W-short run with per-thread CPU sampling
cd /work/main
O=/work/scratch/s2/${NAME:-split1}
rm -rf $O
[ "${SAMPLE:-1}" = 1 ] && ( /work/main/.venv/bin/python /work/scratch/cpuacct.py sample $O.jsonl & echo $! > $O.sampler )
SERVERS="${SERVERS:-split}" OUT=$O VLLM_ARGS="--dtype bfloat16" PEER=/work/peer-qwen \
    PEER_SCRIPTS=/work/shared/peer SERVE_CONFIG_DIR=${CFG:-/work/benchruns/qwen-configs} APP_MODEL=/work/qwen-model \
    SKIP_FLOOR=1 load_tests/peer_bench.sh ${WL:-W-short} > $O.log 2>&1
[ -f $O.sampler ] && kill $(cat $O.sampler)
