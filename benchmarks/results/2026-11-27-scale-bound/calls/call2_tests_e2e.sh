#!/usr/bin/env bash
# H100: test_triton_attention.py's non-FP8 tests, part 2; then the 256-request workload end to end:
# FP8 with the scales-in-L2 probe (wrong outputs, same shapes: a bound) and without, alternating,
# and bf16, for the session's FP8 / bf16 ratio on one machine.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
echo "== tests part 2 $(date +%T)"
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -rf \
  -k "not fp8 and not test_kernel_equals_reference and not test_decode_kernel"
E=benchmarks/results/2026-11-27-cdf-sampler/run_edges.py
echo "== e2e $(date +%T)"
REPS=3 MINIVLLM_PROBE_SCALES_IN_L2=0 timeout 120 python3 $E --fp8 2>&1 | grep " rep " | sed 's/^/real  /'
REPS=3 MINIVLLM_PROBE_SCALES_IN_L2=1 timeout 75 python3 $E --fp8 2>&1 | grep " rep " | sed 's/^/probe /'
REPS=3 timeout 100 python3 $E 2>&1 | grep " rep " | sed 's/^/bf16  /'
REPS=3 MINIVLLM_PROBE_SCALES_IN_L2=0 timeout 70 python3 $E --fp8 2>&1 | grep " rep " | sed 's/^/real  /'
REPS=3 MINIVLLM_PROBE_SCALES_IN_L2=1 timeout 70 python3 $E --fp8 2>&1 | grep " rep " | sed 's/^/probe /'
date
