#!/usr/bin/env bash
# H100: the EngineCore's heap frozen after start-up (MINIVLLM_GC_FREEZE=1, the default) against not
# (=0), alternating; gcprobe prints each process's collector passes over 2 ms.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
export PYTHONPATH=$(pwd)/benchmarks/results/2026-11-27-gc-freeze/gcprobe:$PYTHONPATH
for round in 1 2; do
for mode in fp8 bf16; do
  flag=""; [ $mode = fp8 ] && flag="--fp8"
  for freeze in 1 0; do
    echo "== $mode GC_FREEZE=$freeze $(date +%T)"
    MINIVLLM_GC_FREEZE=$freeze REPS=3 timeout 200 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py $flag 2>&1 | grep -E "rep |GCPROBE pid [0-9]+ gen|objects moved|Error|error" | cut -c1-200 | head -30
  done
done
done
date
