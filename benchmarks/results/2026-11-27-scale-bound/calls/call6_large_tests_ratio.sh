#!/usr/bin/env bash
# H100: test_fp8_cache's large cases with the fresh launch at (64, 32, 4, 3) (call 3 ran 16 of them
# at the old shape, call 4 the other 2); then the 256-request workload, bf16 and FP8 alternating on
# this tree, for the session's FP8 / bf16 ratio on one machine.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
echo "== tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -rf -k "test_fp8_cache and large"
E=benchmarks/results/2026-11-27-cdf-sampler/run_edges.py
for r in 1 2; do
  echo "== bf16 $r $(date +%T)"
  REPS=3 timeout 110 python3 $E 2>&1 | grep " rep "
  echo "== fp8 $r $(date +%T)"
  REPS=3 timeout 100 python3 $E --fp8 2>&1 | grep " rep "
done
date
