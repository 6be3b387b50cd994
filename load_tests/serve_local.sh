# Sourced by the load-test scripts, from the repository root: a local Ray head offering both
# phase tags, one Serve config at a time on it, and cleanup on exit. The caller sets OUT (the
# results folder, created here); PY, BIN and URL default to the project's venv and the app's
# local address; SERVE_CONFIG_DIR (serve_configs) is where serve_config finds NAME.yaml (a
# folder of configs for another model). Starts its own Ray head, so no other Ray may run
# here; stops everything on exit.

PY=${PY:-.venv/bin/python}
BIN=${BIN:-.venv/bin}
URL=${URL:-http://127.0.0.1:8000}
mkdir -p "$OUT"

if "$BIN/ray" status >/dev/null 2>&1; then
  echo "a Ray cluster is already running here; stop it first (ray stop)" >&2
  exit 1
fi

# `serve shutdown` needs the dashboard, which this head does not run: shut Serve down from
# a driver instead.
serve_shutdown() {
  "$PY" -c "import ray; from ray import serve; ray.init(address='auto', \
logging_level='ERROR'); serve.shutdown()" >/dev/null 2>&1 || true
}
cleanup() {
  serve_shutdown
  "$BIN/ray" stop >/dev/null 2>&1 || true
}
trap cleanup EXIT

# DIRECT_INGRESS_PORT (unset: through Serve's proxy): the head starts with Serve's direct
# ingress, the ingress replica serving HTTP on that port (deployments/run_local.py's
# direct_ingress_env); the caller points URL at it
start_head() {
  local env=()
  if [ -n "${DIRECT_INGRESS_PORT:-}" ]; then
    # shellcheck disable=SC2207  # NAME=VALUE words without spaces
    env=($("$PY" -c 'import sys; from deployments.run_local import direct_ingress_env
print(" ".join(f"{k}={v}" for k, v in direct_ingress_env(int(sys.argv[1])).items()))' \
      "$DIRECT_INGRESS_PORT")) || return 1
  fi
  env "${env[@]}" "$BIN/ray" start --head --resources='{"prefill_accel": 2, "decode_accel": 2}' --num-cpus 4 \
    --include-dashboard=false --disable-usage-stats >"$OUT/ray-start.log" 2>&1
}

wait_ready() {
  for _ in $(seq 600); do
    if curl -sf "$URL/health" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  echo "app not ready" >&2
  return 1
}

# serve_config NAME: deploy serve_configs/NAME.yaml and wait for /health
serve_config() {
  # --non-blocking returns once the config is submitted: a failure there (no Ray head to
  # reach, a config Serve refuses) ends the wait at once instead of after wait_ready's 600 s
  if ! PYTHONPATH=$PWD "$BIN/serve" run --non-blocking "${SERVE_CONFIG_DIR:-serve_configs}/$1.yaml" \
    >"$OUT/$1-serve.log" 2>&1; then
    echo "serve run failed for $1.yaml (its log: $OUT/$1-serve.log)" >&2
    return 1
  fi
  wait_ready
}
