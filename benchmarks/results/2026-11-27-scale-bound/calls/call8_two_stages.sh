#!/usr/bin/env bash
# H100: the bf16 decode kernel at 2 stages (this tree) against 3 (.devtmp/base = 2b1e2b7, whose
# bf16 path is otherwise this tree's), alternating: nano-vllm's workload (its batch shrinks, 2 reps
# a run), batch 1; then the decode kernel's GPU tests at 2 stages.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
ROOT=$(pwd)
use() { ln -sfn "$1" /tmp/minivllm-path/minivllm; cd "$1"; }
E=$ROOT/benchmarks/results/2026-11-27-cdf-sampler/run_edges.py
for r in 1 2; do
  use $ROOT; echo "== nano, 2 stages, $r $(date +%T)"
  REPS=2 timeout 90 python3 $E --nano 2>&1 | grep " rep " | cut -c1-120
  use $ROOT/.devtmp/base; echo "== nano, 3 stages, $r $(date +%T)"
  REPS=2 timeout 90 python3 $E --nano 2>&1 | grep " rep " | cut -c1-120
done
for t in $ROOT $ROOT/.devtmp/base; do
  use $t; echo "== batch 1, $t $(date +%T)"
  timeout 50 python3 -m minivllm.frontend.cli bench latency --model benchmarks/configs/qwen3-0.6b --load-format dummy 2>&1 | grep "batch 1"
done
use $ROOT; echo "== decode tests $(date +%T)"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -rf \
  -k "not fp8 and (test_decode or test_mixed_step_padding or test_other_block_sizes)"
date
