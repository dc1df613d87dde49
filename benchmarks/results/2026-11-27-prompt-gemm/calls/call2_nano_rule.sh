#!/usr/bin/env bash
# H100: nano-vllm's workload (bf16) with the decode kernel's 128-sequence rule (this tree: 2 stages
# below 128 sequences, 3 from there) against d06e4f1 (.devtmp/base: 2 stages everywhere),
# alternating, two rounds of 2 reps each.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
ROOT=$(pwd)
use() { ln -sfn "$1" /tmp/minivllm-path/minivllm; cd "$1"; }
E=$ROOT/benchmarks/results/2026-11-27-cdf-sampler/run_edges.py
for r in 1 2; do
  for t in $ROOT $ROOT/.devtmp/base; do
    use $t; echo "== nano $t $(git -C $t rev-parse --short HEAD) $r $(date +%T)"
    REPS=2 timeout 130 python3 $E --nano 2>&1 | grep " rep " | cut -c1-110
  done
done
date
