#!/usr/bin/env bash
# H100: end to end with the engine's processes' start-up heap frozen (MINIVLLM_GC_FREEZE=1, the
# default) against not (=0), alternating, 3 reps a run.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
for round in 1 2; do
for mode in fp8 bf16; do
  flag=""; [ $mode = fp8 ] && flag="--fp8"
  for freeze in 1 0; do
    echo "== $mode GC_FREEZE=$freeze $(date +%T)"
    MINIVLLM_GC_FREEZE=$freeze REPS=3 timeout 200 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py $flag 2>&1 | grep -E " rep |Error|error" | cut -c1-150
  done
done
done
date
