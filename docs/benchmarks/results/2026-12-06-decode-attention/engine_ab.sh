#!/bin/bash
# OLD: a worktree at the commit before (git worktree add $OLD 081d843; its .venv linked to this one), NEW: this checkout
# decode steps old (HEAD, $OLD) vs new (the working tree, $NEW), alternated
for r in 1 2 3; do
  for v in old new; do
    [ $v = old ] && d=$OLD || d=$NEW
    [ $((r % 2)) = 0 ] && { [ $v = old ] && d=$NEW || d=$OLD; v=$([ $v = old ] && echo new || echo old); }
    for c in 256 1024; do
      (cd $d && .venv/bin/python -m load_tests.decode_bench --variants bfloat16+packed --threads 1 --rounds 3 --no-join --no-prefill --context $c 2>&1 | grep -E "step1_ms|step8_ms" | sed "s/^/r$r $v ctx$c /")
    done
  done
done
