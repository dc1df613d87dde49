#!/usr/bin/env bash
# H100: worker/prompt_gemm.py (gate|up + SiLU-and-mul in one Triton kernel for prompt steps): its GPU
# tests, its time against cuBLAS + silu_and_mul from 300 to 16,384 rows, then the 256-request
# workload with it on and off (MINIVLLM_PROMPT_GEMM=0), bf16 and FP8, first round.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date; git log --oneline -1
echo "== tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_prompt_gemm.py -rf 2>&1 | tail -6
echo "== probe $(date +%T)"
timeout 80 python3 benchmarks/gated_gemm_probe.py --engine --rows 300 512 1024 2693 8192 16384
E=benchmarks/results/2026-11-27-cdf-sampler/run_edges.py
for dt in bf16 fp8; do
  flag=$([ $dt = fp8 ] && echo --fp8)
  for g in 1 0; do
    echo "== $dt PROMPT_GEMM=$g $(date +%T)"
    MINIVLLM_PROMPT_GEMM=$g REPS=3 timeout 85 python3 $E $flag 2>&1 | grep " rep " | cut -c1-100
  done
done
date
