#!/usr/bin/env bash
# H100: the 256-request workload with worker/prompt_gemm.py on and off, second round (off first this
# time); then test_gpu_engine.py's bf16 tests, whose prompt steps now take the kernel.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date; git log --oneline -1
E=benchmarks/results/2026-11-27-cdf-sampler/run_edges.py
for dt in bf16 fp8; do
  flag=$([ $dt = fp8 ] && echo --fp8)
  for g in 0 1; do
    echo "== $dt PROMPT_GEMM=$g $(date +%T)"
    MINIVLLM_PROMPT_GEMM=$g REPS=3 timeout 85 python3 $E $flag 2>&1 | grep " rep " | cut -c1-100
  done
done
echo "== test_gpu_engine $(date +%T)"
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py -rf \
  -k "not test_fp32_cuda_equals_cpu_reference and not test_new_turns_after_a_long_cached_prefix" 2>&1 | tail -5
date
