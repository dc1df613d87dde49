#!/usr/bin/env bash
# H100: test_triton_attention's FP8 tests after quantize divides as the kernels do; the session's
# figures on the new tree (256 requests, bf16 and FP8, 3 reps each).
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
echo "== tests/gpu/test_triton_attention.py -k fp8 $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -k fp8 2>&1 | grep -E "^E |passed|failed" | head -12
for mode in bf16 fp8; do
  flag=""; [ $mode = fp8 ] && flag="--fp8"
  echo "== $mode e2e $(date +%T)"
  REPS=3 timeout 150 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py $flag 2>&1 | grep -E " rep |Error|error" | cut -c1-120
done
date
