#!/usr/bin/env bash
# H100: the 256-request workload end to end with an FP8 cache, this tree (the prompt steps' two
# launches side by side) against HEAD before it (.devtmp/base = 2b1e2b7), alternating, 3 reps a
# run; then this tree with MINIVLLM_PREFILL_JOINS=0 (the launches one after the other).
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
ROOT=$(pwd)
use() { ln -sfn "$1" /tmp/minivllm-path/minivllm; cd "$1"; }
E=$ROOT/benchmarks/results/2026-11-27-cdf-sampler/run_edges.py
for r in 1 2; do
  use $ROOT; echo "== new $r $(date +%T)"
  REPS=3 timeout 110 python3 $E --fp8 2>&1 | grep " rep " | sed 's/^/new  /'
  use $ROOT/.devtmp/base; echo "== base $r $(date +%T)"
  REPS=3 timeout 110 python3 $E --fp8 2>&1 | grep " rep " | sed 's/^/base /'
done
use $ROOT; echo "== new, MINIVLLM_PREFILL_JOINS=0 $(date +%T)"
MINIVLLM_PREFILL_JOINS=0 REPS=3 timeout 70 python3 $E --fp8 2>&1 | grep " rep " | sed 's/^/nojoin /'
date
