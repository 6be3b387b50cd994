#!/usr/bin/env bash
# The kernels at each of COMMITS (default: 566df23, before; d8c2d54, the tile set-up, 8 x 3
# prefill tiles and the attention's full steps; 262244b, row blocks largest first), engine
# alone, EPYC-BF16, bf16: pass_bench (2 threads: a 1,024-token pass, the same in 256-token
# chunks, the two mixed passes), decode_bench (1 thread: batch-1 and batch-8 steps, a
# 1,024-token prefill) and products.py (1 thread: the products and the prefill attention
# alone). ROUNDS (3) rounds, each one run of each commit, the order rotated. Git worktrees
# (made here if missing) share the checkout's .venv; each builds its own kernel library (the
# library's name hashes its sources). Run from the checkout, with nothing else running.
set -euo pipefail
COMMITS=${COMMITS:-"566df23 d8c2d54 262244b"} ROUNDS=${ROUNDS:-3}
OUT=$(cd "${OUT:-$(dirname "$0")}" && pwd)
ROOT=$(pwd)
read -ra list <<< "$COMMITS"
for c in "${list[@]}"; do
  t=/tmp/ab-tree-$c
  [ -d "$t" ] || git worktree add "$t" "$c" --detach >/dev/null
  ln -sfn "$ROOT/.venv" "$t/.venv"
done
for r in $(seq "$ROUNDS"); do
  n=${#list[@]}
  for i in $(seq 0 $((n - 1))); do
    c=${list[$(((i + r - 1) % n))]}
    cd /tmp/ab-tree-$c
    .venv/bin/python -m load_tests.pass_bench --variants bfloat16 --threads 2 --rounds 1 \
      --json "$OUT/pass-$c-$r.json" > "$OUT/pass-$c-$r.txt" 2>&1
    .venv/bin/python -m load_tests.decode_bench --variants bfloat16+packed --threads 1 \
      --rounds 1 --no-join --json "$OUT/decode-$c-$r.json" > "$OUT/decode-$c-$r.txt" 2>&1
    PYTHONPATH=. .venv/bin/python "$OUT/products.py" > "$OUT/products-$c-$r.txt" 2>&1
    cd "$ROOT"
  done
done
