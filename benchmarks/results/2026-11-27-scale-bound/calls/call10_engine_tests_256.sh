#!/usr/bin/env bash
# H100: the engine's GPU tests call 9's limit cut off (CUDA graphs against eager in bf16, HF
# agreement, the qkv epilogue's RoPE, the worker in the engine process, the LM head's warm-up,
# vLLM's budget), with the bf16 decode kernel at 2 stages; then the 256-request bf16 workload,
# .devtmp/base (2b1e2b7, 3 stages) and this tree alternating, twice each (call 9's one pair had
# this tree 0.6% slower).
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
ROOT=$(pwd)
use() { ln -sfn "$1" /tmp/minivllm-path/minivllm; cd "$1"; }
E=$ROOT/benchmarks/results/2026-11-27-cdf-sampler/run_edges.py
echo "== test_gpu_engine $(date +%T)"
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py -rf \
  -k "not fp8 and not test_fp32_cuda_equals_cpu_reference and not test_new_turns_after_a_long_cached_prefix" 2>&1 | tail -5
for r in 1 2; do
  for t in $ROOT/.devtmp/base $ROOT; do
    use $t; echo "== 256 requests bf16, $t, $r $(date +%T)"
    REPS=2 timeout 55 python3 $E 2>&1 | grep " rep " | cut -c1-100
  done
done
date
