#!/usr/bin/env bash
# vLLM bf16, the colocated app at this checkout (/work/main: "new") and at a worktree of the
# base commit (/work/scratch/s9/old, its kernels built into its own SPLITSERVE_CACHE: "old"),
# three rounds with the order rotated; MODEL=qwen: the Qwen-shaped model
# (python -m load_tests.make_model /work/qwen-model; /work/peer-qwen holds links vllm-venv ->
# the peer's and smollm2-hf -> the model; /work/benchruns/qwen-configs the committed serve
# configs with engine.model set to the model's folder), else SmolLM2 (PEER=/work/peer).
# Afterwards each round's result files were moved into round-N/ (the old app's renamed
# colocated-base_<workload>.json) for load_tests/peer_rounds.py.
R=${R:?}; WL=${WL:-W-short}; MODEL=${MODEL:-qwen}
mkdir -p $R
orders=("vllm new old" "new old vllm" "old vllm new")
for r in ${ROUNDS:-1 2 3}; do
  for s in ${orders[$(( (r-1) % 3 ))]}; do
    ray stop --force >/dev/null 2>&1; pkill -9 -f gcs_server; pkill -9 -f raylet; sleep 3
    if [ $MODEL = qwen ]; then M="PEER=/work/peer-qwen SERVE_CONFIG_DIR=/work/benchruns/qwen-configs APP_MODEL=/work/qwen-model"; else M="PEER=/work/peer"; fi
    case $s in
      vllm) (cd /work/main && env $M SERVERS=vllm OUT=$R/r$r-vllm VLLM_ARGS="--dtype bfloat16" PEER_SCRIPTS=/work/shared/peer SKIP_FLOOR=1 load_tests/peer_bench.sh $WL > $R/r$r-vllm.log 2>&1) ;;
      new) (cd /work/main && env $M SERVERS=colocated OUT=$R/r$r-new PEER_SCRIPTS=/work/shared/peer SKIP_FLOOR=1 load_tests/peer_bench.sh $WL > $R/r$r-new.log 2>&1) ;;
      old) (cd /work/scratch/s9/old && env $M PY=/work/main/.venv/bin/python BIN=/work/main/.venv/bin PYTHONPATH=/work/scratch/s9/old SPLITSERVE_CACHE=/work/scratch/s9/oldcache SERVERS=colocated OUT=$R/r$r-old PEER_SCRIPTS=/work/shared/peer SKIP_FLOOR=1 load_tests/peer_bench.sh $WL > $R/r$r-old.log 2>&1) ;;
    esac
    echo "round $r $s done rc=$? $(date +%T)"
  done
done
