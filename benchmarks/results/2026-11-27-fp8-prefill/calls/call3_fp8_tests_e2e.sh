#!/usr/bin/env bash
# H100: the rest of test_triton_attention.py's FP8 tests (decode kernels; owed since the bfloat16
# scales); the FP8 prefill steps against the start's triton_attention.py with the chunk's own keys
# (call 2's baseline lines called it without them); each launch alone on the start tree; then the
# 256-request FP8 workload end to end, this tree against the start (.devtmp/base = cbdb798),
# alternating, twice each.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
NEW=$(pwd); BASE=$(pwd)/.devtmp/base
use() { ln -sfn "$1" /tmp/minivllm-path/minivllm; cd "$1"; }
use $NEW
echo "== tests $(date +%T)"
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -rf \
  -k "fp8 and not test_fp8_cache and not test_fp8_cached"
echo "== tune_attention fp8, baseline with own keys $(date +%T)"
timeout 60 python3 benchmarks/tune_attention.py --fp8 --cudagraph --no-sweep \
  --cases prefill-16384-after-chunk,prefill-16384xragged,prefill-8192-after-8k \
  --baseline .devtmp/base/worker/attention/triton_attention.py 2>&1 | grep -v SDPA
for round in 1 2; do
  for tree in $NEW $BASE; do
    use $tree
    echo "== fp8 e2e $(basename $tree) $(date +%T)"
    REPS=3 timeout 90 python3 $NEW/benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --fp8 2>&1 | grep -E " rep |Error|error" | cut -c1-120
  done
done
use $BASE
echo "== launch_costs, start tree $(date +%T)"
timeout 60 python3 $NEW/benchmarks/results/2026-11-27-fp8-prefill/launch_costs.py 2>&1 | grep -E "H100|H200|450 after|900 after|Error"
date
