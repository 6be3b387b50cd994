set -u
cd /work/main
for r in 1 2; do
  for c in 256 1024; do
    cp /tmp/prof/local.yaml.bak serve_configs/local.yaml
    if [ $c = 1024 ]; then sed -i 's/^        prefill_token_budget: 4096$/        prefill_token_budget: 4096\n        prefill_chunk_tokens: 1024/' serve_configs/local.yaml; fi
    PEER=/work/peer DTYPES=bfloat16 SERVERS="split" WORKLOADS="W-mixed" ROUNDS=1 OUT=/tmp/prof/mixed_c${c}_r${r} load_tests/bench_peers.sh > /tmp/prof/mixed_c${c}_r${r}.log 2>&1
  done
done
cp /tmp/prof/local.yaml.bak serve_configs/local.yaml
echo done
