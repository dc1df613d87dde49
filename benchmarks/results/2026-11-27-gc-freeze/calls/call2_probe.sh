#!/usr/bin/env bash
# H100: upper bound of removing the decode-step add+RMSNorm kernels (probe sitecustomize), alternating.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
export PYTHONPATH=$(pwd)/benchmarks/results/2026-11-27-gc-freeze/no_norm_probe:$PYTHONPATH
for round in 1 2; do
for mode in fp8 bf16; do
  flag=""; [ $mode = fp8 ] && flag="--fp8"
  for probe in 0 1; do
    echo "== $mode NO_NORM=$probe $(date +%T)"
    MINIVLLM_PROBE_NO_NORM=$probe REPS=3 timeout 200 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py $flag 2>&1 | grep -E "rep |PROBE|Error|error" | head -8
  done
done
done

echo "== nano bf16 $(date +%T)"
REPS=3 timeout 150 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --nano 2>&1 | grep -E "rep |Error|error" | head -5

date
