#!/usr/bin/env bash
# H100: a second A/B of the frozen start-up heap, bf16 twice and FP8 once, alternating, 3 reps a run.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
for mode in bf16 bf16 fp8; do
  flag=""; [ $mode = fp8 ] && flag="--fp8"
  for freeze in 0 1; do
    echo "== $mode GC_FREEZE=$freeze $(date +%T)"
    MINIVLLM_GC_FREEZE=$freeze REPS=3 timeout 200 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py $flag 2>&1 | grep -E " rep |Error|error" | cut -c1-110
  done
done
date
