#!/usr/bin/env bash
# H100: a Triton GEMM with SiLU-and-mul in its epilogue at prompt-step sizes against cuBLAS +
# silu_and_mul (gated_gemm_probe.py); then the owed FP8 tests of test_triton_attention.py: the 5
# large test_fp8_cache cases last run only in the CPU interpreter, and the 43 small-step FP8 tests.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
echo "== probe $(date +%T)"
timeout 280 python3 benchmarks/gated_gemm_probe.py --rows 16384 8192 2048
echo "== tests $(date +%T)"
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -rf \
  -k "(test_fp8_cache and (large-32-4-128 or large-7-1-64 or large-7-1-96 or large-7-1-128 or large-7-4-64)) or (fp8 and not test_fp8_cache and not test_fp8_cached and not test_fp8_step)" 2>&1 | tail -8
date
