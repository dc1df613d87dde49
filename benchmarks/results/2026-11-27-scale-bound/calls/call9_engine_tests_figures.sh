#!/usr/bin/env bash
# H100: the engine's GPU tests but the FP8 ones (those passed in call 4) with the bf16 decode kernel at 2 stages;
# nano-vllm's workload again (this tree); the 256-request bf16 workload, this tree against
# .devtmp/base (2b1e2b7, 3 stages).
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
ROOT=$(pwd)
use() { ln -sfn "$1" /tmp/minivllm-path/minivllm; cd "$1"; }
E=$ROOT/benchmarks/results/2026-11-27-cdf-sampler/run_edges.py
echo "== test_gpu_engine $(date +%T)"
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py -rf -k "not fp8"
for r in 1 2; do
  use $ROOT; echo "== nano, 2 stages, $r $(date +%T)"
  REPS=2 timeout 80 python3 $E --nano 2>&1 | grep " rep " | cut -c1-120
done
for t in $ROOT $ROOT/.devtmp/base; do
  use $t; echo "== 256 requests bf16, $t $(date +%T)"
  REPS=3 timeout 70 python3 $E 2>&1 | grep " rep " | cut -c1-120
done
date
