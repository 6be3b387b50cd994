#!/usr/bin/env bash
# Issue 13: this app and vLLM's CPU build side by side on this machine, with the same client
# (`vllm bench serve`: random dataset, /v1/completions, --ignore-eos, temperature 0, same
# seeds), one server at a time, never two at once:
#
#   vllm       vLLM-CPU (the peer's start_vllm.sh), on VLLM_PORT
#   split      this app as `make run` serves it (serve_configs/local.yaml), on APP_PORT
#   colocated  the colocated baseline (serve_configs/local-colocated.yaml), on APP_PORT
#
# Each server is started, waited for, warmed up (a few untimed requests of both shapes: 64 and
# 1024-token prompts), measured on every selected workload, and stopped before the next one
# starts. Then a side-by-side table of the result files is printed (load_tests/peer_table.py)
# and saved as $OUT/table.md.
#
#   flock /tmp/splitserve-ray-cluster.lock \
#     env PEER=<vLLM scratch folder> load_tests/peer_bench.sh [WORKLOAD ...]
#
# WORKLOAD: W-short (default; 64 in / 64 out, 64 prompts, 8 concurrent, seed 1), W-single
# (64 in / 64 out, 8 prompts, one at a time, seed 5: TPOT at concurrency 1), W-long
# (1024 in / 16 out, 16 prompts, 4 concurrent, seed 2), W-mixed (the peer's mixed.sh: 16
# streams of 64 in / 256 out, 8 at a time, while 16 prompts of 1024 tokens arrive at 0.5/s;
# seeds 3 and 4), W-chat (W-mixed's streams alone, no documents, seed 3: the chats' own
# TTFT, which W-mixed's chat TTFT p90 is held against), or all.
#
# PEER is a folder set up by the peer's setup.sh (vllm-venv/, smollm2-hf/), outside the
# checkout. The peer scripts (bench.sh, start_vllm.sh, mixed.sh) are taken from PEER_SCRIPTS,
# else $PEER/peer/, else ../shared/peer/ next to the checkout.
#
# Knobs (environment): SERVERS ("vllm split"; add colocated for the baseline), OUT (results
# folder, load_tests/results/peer-<time>), VLLM_PORT (8101), APP_PORT (8000: must match the
# configs' http_options.port; DIRECT_INGRESS_PORT, when set, instead: Serve's direct ingress,
# load_tests/serve_local.sh), APP_MODEL (smollm2-135m-instruct, the model id the app
# serves), VLLM_ARGS (extra `vllm serve` arguments, e.g. "--dtype bfloat16"),
# VLLM_READY_TIMEOUT (1800 s: vLLM's first start compiles, 2-6 min on an idle machine, far
# longer on a loaded one), BENCH_TIMEOUT (1800 s per client run), PY (.venv/bin/python),
# VLLM_LABEL (vllm: the name vLLM's result files carry, e.g. vllm-matched for a second vLLM
# configuration in the same folder), SKIP_FLOOR (1: no decode_bench run; load_tests/
# bench_peers.sh measures the read bandwidth instead), FLOOR_DTYPE (the dtype of that run, on
# APP_MODEL: default the `--dtype` in VLLM_ARGS, else float32). Several runs may share one OUT: each
# appends to its run-info.txt. `make bench-peers` (load_tests/bench_peers.sh) runs this script
# in interleaved, rotated rounds.
#
# Results: $OUT/<server>_<workload>.json (vllm bench serve's saved result, with per-request
# detail), $OUT/logs/ (server and client logs), $OUT/warmup/ (the untimed warm-up runs).
# The app half starts its own Ray head (load_tests/serve_local.sh), so no other Ray may run
# here; everything this script starts is stopped on exit, Ctrl-C included.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "peer_bench: $*" >&2; exit 2; }

# ---- arguments and set-up checks (before anything starts) ----
workloads=()
for w in "${@:-W-short}"; do
  case $w in
    W-short|W-single|W-long|W-mixed|W-chat) workloads+=("$w") ;;
    all) workloads+=(W-short W-single W-long W-mixed W-chat) ;;
    *) die "unknown workload '$w' (W-short, W-single, W-long, W-mixed, W-chat, all)" ;;
  esac
done
SERVERS=${SERVERS:-"vllm split"}
for s in $SERVERS; do
  case $s in vllm|split|colocated) ;; *) die "unknown server '$s' in SERVERS (vllm split colocated)" ;; esac
done

# shellcheck source=load_tests/peer_env.sh
source load_tests/peer_env.sh
check_peer

VLLM_PORT=${VLLM_PORT:-8101}
APP_PORT=${DIRECT_INGRESS_PORT:-${APP_PORT:-8000}}  # Serve's direct ingress: the client calls the replica
APP_MODEL=${APP_MODEL:-smollm2-135m-instruct}
VLLM_READY_TIMEOUT=${VLLM_READY_TIMEOUT:-1800}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-1800}
OUT=${OUT:-load_tests/results/peer-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT/logs" "$OUT/warmup"
OUT=$(cd "$OUT" && pwd)
PY=${PY:-.venv/bin/python}
TABLE_PY=$PY
[ -x "$TABLE_PY" ] || TABLE_PY=python3   # peer_table.py needs only the standard library

case " $SERVERS " in
  *" split "*|*" colocated "*)
    [ -x "$PY" ] || die "$PY is missing: run make setup first (the app half needs the project's venv)"
    "${BIN:-.venv/bin}/ray" status >/dev/null 2>&1 \
      && die "a Ray cluster is already running here; stop it first (ray stop)" ;;
esac

answers() { curl -sf -m 5 "$1" >/dev/null 2>&1; }
answers "http://127.0.0.1:$VLLM_PORT/v1/models" && die "something already answers on port $VLLM_PORT"
answers "http://127.0.0.1:$APP_PORT/v1/models" && die "something already answers on port $APP_PORT"

{
  echo "date: $(date -Is)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' (dirty)')"
  echo "vllm: $("$PEER/vllm-venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null)"
  echo "servers: $SERVERS"
  echo "workloads: ${workloads[*]}"
  echo "cpus: $(nproc)"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee -a "$OUT/run-info.txt"

# ---- stopping what we started ----
VLLM_PID=
HEAD_STARTED=0
stop_vllm() {
  [ -n "$VLLM_PID" ] || return 0
  kill -TERM -- "-$VLLM_PID" 2>/dev/null || true
  for _ in $(seq 60); do
    kill -0 -- "-$VLLM_PID" 2>/dev/null || break
    sleep 1
  done
  kill -KILL -- "-$VLLM_PID" 2>/dev/null || true
  VLLM_PID=
}
on_exit() {
  local rc=$?
  stop_vllm
  if [ "$HEAD_STARTED" = 1 ]; then cleanup; fi   # serve_local.sh: Serve shutdown, ray stop
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# ---- one client run ----
failed=()
# bench LABEL PORT SERVED IN OUT N CONCURRENCY RATE SEED [RESULT_DIR]
bench() {
  local label=$1 port=$2 served=$3 il=$4 ol=$5 n=$6 mc=$7 rate=$8 seed=$9 dir=${10:-$OUT}
  echo "-- $label: $il in / $ol out, $n prompts, concurrency $mc, rate $rate, seed $seed"
  if ! PEER=$PEER SERVED=$served SEED=$seed RESULT_DIR=$dir timeout "$BENCH_TIMEOUT" \
      "$PEER_SCRIPTS/bench.sh" "$label" "$port" "$il" "$ol" "$n" "$mc" "$rate" --ignore-eos \
      >"$OUT/logs/$label.log" 2>&1; then
    echo "   FAILED (see $OUT/logs/$label.log):" >&2
    tail -5 "$OUT/logs/$label.log" >&2
    return 1
  fi
  grep -E '^(Successful requests|Output token throughput|Median TTFT|Median TPOT|P99 ITL)' \
    "$OUT/logs/$label.log" | sed 's/^/   /' || true
}

# measure SERVER PORT SERVED: warm up, then every selected workload
measure() {
  local server=$1 port=$2 served=$3 w
  echo "== $server: warm-up (untimed, results in $OUT/warmup)"
  bench "${server}_warmup-short" "$port" "$served" 64 16 8 8 inf 11 "$OUT/warmup" \
    || { failed+=("$server warm-up"); return 0; }
  bench "${server}_warmup-long" "$port" "$served" 1024 4 2 2 inf 12 "$OUT/warmup" \
    || { failed+=("$server warm-up"); return 0; }
  for w in "${workloads[@]}"; do
    echo "== $server: $w"
    case $w in
      W-short) bench "${server}_W-short" "$port" "$served" 64 64 64 8 inf 1 || failed+=("${server}_W-short") ;;
      W-single) bench "${server}_W-single" "$port" "$served" 64 64 8 1 inf 5 || failed+=("${server}_W-single") ;;
      W-long) bench "${server}_W-long" "$port" "$served" 1024 16 16 4 inf 2 || failed+=("${server}_W-long") ;;
      W-chat) bench "${server}_W-chat" "$port" "$served" 64 256 16 8 inf 3 || failed+=("${server}_W-chat") ;;
      W-mixed)
        # mixed.sh: two clients at once (seeds 3 and 4), logs under $PEER/logs
        PEER=$PEER SERVED=$served RESULT_DIR=$OUT "$PEER_SCRIPTS/mixed.sh" "$server" "$port" \
          | tee "$OUT/logs/${server}_W-mixed.log"
        cp "$PEER/logs/${server}_W-mixed-streams.log" "$PEER/logs/${server}_W-mixed-long.log" \
          "$OUT/logs/" 2>/dev/null || true
        for part in streams long; do
          [ -s "$OUT/${server}_W-mixed-$part.json" ] || failed+=("${server}_W-mixed-$part")
        done ;;
    esac
  done
}

# ---- (a) vLLM-CPU ----
run_vllm() {
  local log=$OUT/logs/${VLLM_LABEL:-vllm}-server.log
  echo "== vllm: starting on port $VLLM_PORT (log $log)"
  # setsid: its own process group (API server + engine core), stopped as one; start_vllm.sh
  # writes its PID (the group's id) to $PEER/vllm.pid before it execs vllm
  rm -f "$PEER/vllm.pid"
  # shellcheck disable=SC2086  # VLLM_ARGS is a list of words
  PEER=$PEER setsid "$PEER_SCRIPTS/start_vllm.sh" --port "$VLLM_PORT" ${VLLM_ARGS:-} \
    >"$log" 2>&1 &
  local t0=$SECONDS
  for _ in $(seq 50); do [ -s "$PEER/vllm.pid" ] && break; sleep 0.2; done
  VLLM_PID=$(cat "$PEER/vllm.pid" 2>/dev/null || true)
  VLLM_PID=${VLLM_PID:-$!}
  until answers "http://127.0.0.1:$VLLM_PORT/v1/models"; do
    if ! kill -0 "$VLLM_PID" 2>/dev/null; then
      tail -20 "$log" >&2
      stop_vllm; failed+=("vllm start"); echo "vLLM exited before it was ready" >&2; return 0
    fi
    if (( SECONDS - t0 > VLLM_READY_TIMEOUT )); then
      tail -20 "$log" >&2
      stop_vllm; failed+=("vllm start"); echo "vLLM not ready after ${VLLM_READY_TIMEOUT}s" >&2; return 0
    fi
    sleep 2
  done
  echo "   ready after $((SECONDS - t0)) s" | tee -a "$OUT/run-info.txt"
  echo "   vllm serve arguments: ${VLLM_ARGS:-} (label ${VLLM_LABEL:-vllm})" >>"$OUT/run-info.txt"
  measure "${VLLM_LABEL:-vllm}" "$VLLM_PORT" smollm2
  echo "== vllm: stopping"
  stop_vllm
}

# ---- (b), (c) this app, on a local Ray head (load_tests/serve_local.sh) ----
run_app() {
  local server=$1 cfg=$2 t0=$SECONDS
  echo "== $server: serve_configs/$cfg.yaml on port $APP_PORT (log $OUT/logs/$cfg-serve.log)"
  if [ "$HEAD_STARTED" = 0 ]; then
    # sets PY, BIN, URL; checks no Ray runs; its EXIT trap is replaced by on_exit above
    URL=http://127.0.0.1:$APP_PORT
    # shellcheck source=load_tests/serve_local.sh
    source load_tests/serve_local.sh
    trap on_exit EXIT
    HEAD_STARTED=1
    start_head
  fi
  if ! OUT=$OUT/logs serve_config "$cfg"; then
    failed+=("$server start"); tail -20 "$OUT/logs/$cfg-serve.log" >&2; serve_shutdown; return 0
  fi
  echo "   ready after $((SECONDS - t0)) s" | tee -a "$OUT/run-info.txt"
  echo "   serve config: ${SERVE_CONFIG_DIR:-serve_configs}/$cfg.yaml" >>"$OUT/run-info.txt"
  measure "$server" "$APP_PORT" "$APP_MODEL"
  echo "== $server: stopping"
  serve_shutdown
}

# the floor a decode step stands against (one GEMV over the model's weight bytes on the decode
# replica's one thread) and the engine's own step, in the same run as the servers
if [ -x "$PY" ] && [ "${SKIP_FLOOR:-0}" != 1 ]; then
  echo "== decode step against the floor (load_tests/decode_bench.py, one thread)"
  floor_dtype=${FLOOR_DTYPE:-$(sed -nE 's/.*--dtype[ =]([a-z0-9]+).*/\1/p' <<<"${VLLM_ARGS:-}")}
  "$PY" -m load_tests.decode_bench --variants "${floor_dtype:-float32}+packed" --rounds 3 \
    --steps 6 --no-join --model "$APP_MODEL" \
    --json "$OUT/decode_bench.json" 2>/dev/null | tee "$OUT/decode_bench.txt" \
    || failed+=("decode_bench")
fi

for s in $SERVERS; do
  case $s in
    vllm) run_vllm ;;
    split) run_app split local ;;
    colocated) run_app colocated local-colocated ;;
  esac
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/run-info.txt"

echo
"$TABLE_PY" load_tests/peer_table.py "$OUT" | tee "$OUT/table.md" || true
echo "results in $OUT"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
