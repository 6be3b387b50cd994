# Sourced by peer_bench.sh and bench_peers.sh: check_peer checks PEER (a folder the peer's
# setup.sh filled: vllm-venv/, smollm2-hf/) and finds PEER_SCRIPTS (the peer's bench.sh,
# start_vllm.sh, mixed.sh: PEER_SCRIPTS, else $PEER/peer, else ../shared/peer beside the
# checkout); both end absolute. Calls the sourcing script's die on what is missing.
check_peer() {
  [ -n "${PEER:-}" ] || die "set PEER to the scratch folder where the peer's setup.sh installed vLLM
  (PEER=<folder outside the checkout> <peer scripts>/setup.sh, about 10 minutes)"
  [ -d "$PEER" ] || die "PEER folder '$PEER' does not exist; run the peer's setup.sh with PEER set to it"
  PEER=$(cd "$PEER" && pwd)
  [ -x "$PEER/vllm-venv/bin/vllm" ] || die "$PEER/vllm-venv/bin/vllm is missing: PEER is not set up (run the peer's setup.sh)"
  [ -f "$PEER/smollm2-hf/config.json" ] || die "$PEER/smollm2-hf/ (the converted model) is missing: the peer's setup.sh did not finish"
  if [ -z "${PEER_SCRIPTS:-}" ]; then
    local d
    for d in "$PEER/peer" "$PWD/../shared/peer"; do
      if [ -f "$d/bench.sh" ]; then PEER_SCRIPTS=$d; break; fi
    done
  fi
  [ -n "${PEER_SCRIPTS:-}" ] || die "peer scripts not found in \$PEER/peer or ../shared/peer: set PEER_SCRIPTS"
  PEER_SCRIPTS=$(cd "$PEER_SCRIPTS" && pwd)
  local f
  for f in bench.sh start_vllm.sh mixed.sh; do
    [ -f "$PEER_SCRIPTS/$f" ] || die "$PEER_SCRIPTS/$f is missing"
  done
}
