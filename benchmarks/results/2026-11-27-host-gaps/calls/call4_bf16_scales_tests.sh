#!/usr/bin/env bash
# H100: the GPU tests that reach the FP8 cache's scales (after the first call's test fix), then one
# more FP8 end-to-end pair, start tree (.devtmp/base) and new.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
NEW=$(pwd); BASE=$(pwd)/.devtmp/base
use() { ln -sfn "$1" /tmp/minivllm-path/minivllm; cd "$1"; }
use $NEW
t() { echo "== $* $(date +%T)"; timeout 200 python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | grep -vE "^\.+ +\[" | tail -8; }
t tests/gpu/test_fp8_decode.py
t tests/gpu/test_triton_attention.py -k fp8
t tests/gpu/test_hopper_gemm.py -k rope
t tests/gpu/test_ops.py -k "fp8 or store"
t tests/gpu/test_gpu_engine.py -k fp8
for tree in $BASE $NEW; do
  use $tree
  echo "== fp8 e2e $(basename $tree) $(date +%T)"
  REPS=3 timeout 80 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --fp8 2>&1 | grep -E " rep |Error|error" | cut -c1-120
done
date
