#!/usr/bin/env bash
# H100: test_prompt_gemm.py on the final tree (the gate|up kernel from 2,048 rows; linear_rope
# reverted), then nano-vllm's workload (bf16; its prompt steps are 16,384 tokens too) with the kernel
# and without (MINIVLLM_PROMPT_GEMM=0).
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
echo "== tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_prompt_gemm.py -rf 2>&1 | tail -8
E=benchmarks/results/2026-11-27-cdf-sampler/run_edges.py
for g in 1 0 1; do
  echo "== nano PROMPT_GEMM=$g $(date +%T)"
  MINIVLLM_PROMPT_GEMM=$g REPS=2 timeout 120 python3 $E --nano 2>&1 | grep " rep " | cut -c1-100
done
date
