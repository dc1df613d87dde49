#!/usr/bin/env bash
# H100: FP8 caches with bfloat16 scales. The FP8-touching GPU tests on the new tree; the FP8 decode
# kernel alone (tune_attention.py, CUDA graphs) on the start tree (.devtmp/base, float32 scales) and
# the new; then the 256-request FP8 workload alternating start / new.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
NEW=$(pwd); BASE=$(pwd)/.devtmp/base
use() { ln -sfn "$1" /tmp/minivllm-path/minivllm; cd "$1"; }
use $NEW
echo "== GPU tests (new) $(date +%T)"
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_decode.py tests/gpu/test_triton_attention.py \
  tests/gpu/test_hopper_gemm.py tests/gpu/test_ops.py tests/gpu/test_hopper_prefill.py 2>&1 | tail -15
for tree in $BASE $NEW $BASE $NEW; do
  use $tree
  echo "== decode kernel alone, FP8, $(basename $tree) $(date +%T)"
  timeout 60 python3 benchmarks/tune_attention.py --cases decode-256x700,decode-256xragged --fp8 --no-sweep --cudagraph 2>&1 | grep -iE "decode|TB/s|error" | head -6
done
for round in 1 2; do
  for tree in $BASE $NEW; do
    use $tree
    echo "== fp8 e2e $(basename $tree) $(date +%T)"
    REPS=3 timeout 100 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --fp8 2>&1 | grep -E " rep |Error|error" | cut -c1-120
  done
done
date
