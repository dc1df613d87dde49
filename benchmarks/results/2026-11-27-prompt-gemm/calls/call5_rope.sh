#!/usr/bin/env bash
# H100: prompt_gemm.linear_rope (qkv + q/k norm + RoPE + K/V store in one Triton kernel for prompt
# steps): test_prompt_gemm.py, its time against cuBLAS + norm_rope, then the 256-request workload
# with both prompt kernels (MINIVLLM_PROMPT_GEMM=1) against the gate|up one alone (=silu), bf16 and FP8.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date; git log --oneline -1
echo "== tests $(date +%T)"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_prompt_gemm.py -rf -x 2>&1 | tail -15
echo "== probe $(date +%T)"
timeout 80 python3 benchmarks/gated_gemm_probe.py --rope --rows 2048 2693 8192 16384
E=benchmarks/results/2026-11-27-cdf-sampler/run_edges.py
for dt in bf16 fp8; do
  flag=$([ $dt = fp8 ] && echo --fp8)
  for g in 1 silu; do
    echo "== $dt PROMPT_GEMM=$g $(date +%T)"
    MINIVLLM_PROMPT_GEMM=$g REPS=3 timeout 80 python3 $E $flag 2>&1 | grep " rep " | cut -c1-100
  done
done
date
