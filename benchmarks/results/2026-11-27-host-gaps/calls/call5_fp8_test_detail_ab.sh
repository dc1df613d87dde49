#!/usr/bin/env bash
# H100: why test_fp8_cache fails with bfloat16 scales (two cases, full message); one more FP8
# end-to-end pair, start tree (.devtmp/base) and new.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
NEW=$(pwd); BASE=$(pwd)/.devtmp/base
use() { ln -sfn "$1" /tmp/minivllm-path/minivllm; cd "$1"; }
use $NEW
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -k "test_fp8_cache and (decode-16-1-128 or mixed-16-1-128)" 2>&1 | grep -E "^E |Error|assert|passed|failed" | head -30
for tree in $BASE $NEW $BASE $NEW; do
  use $tree
  echo "== fp8 e2e $(basename $tree) $(date +%T)"
  REPS=3 timeout 150 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --fp8 2>&1 | grep -E " rep |Error|error" | cut -c1-120
done
date
