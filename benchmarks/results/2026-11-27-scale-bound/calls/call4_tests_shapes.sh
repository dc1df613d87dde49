#!/usr/bin/env bash
# H100: the FP8 step tests call 3's 300 s cut off (the join test with the wait in place, the cached
# chunks' kernel, two large test_fp8_cache cases), now with the fresh launch at (64, 32, 4, 3);
# the engine's FP8 tests; the prefill steps against HEAD's triton_attention.py (.devtmp/base =
# 2b1e2b7); the fresh launch's shapes again, 64-row tiles around the new default.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
T=tests/gpu/test_triton_attention.py
echo "== tests $(date +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider $T -rf \
  -k "test_fp8_step_launches or test_fp8_cached_chunks_kernel or large-7-4-96 or large-7-4-128"
echo "== engine fp8 tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py -rf -k fp8
B=.devtmp/base/worker/attention/triton_attention.py
C=prefill-16384-after-chunk,prefill-16384xragged,prefill-8192-after-8k
for r in 1 2; do
  echo "== tune fp8, round $r $(date +%T)"
  timeout 90 python3 benchmarks/tune_attention.py --fp8 --cudagraph --no-sweep --cases $C --baseline $B
done
echo "== fresh launch shapes $(date +%T)"
timeout 80 python3 benchmarks/tune_attention.py --fp8 --cudagraph --fresh-sweep --cases prefill-16384xragged,prefill-16384-after-chunk --top 6 \
  --configs "64,32,4,3,none;64,32,4,2,none;64,32,4,4,none;64,64,4,2,none;128,32,8,3,128;64,16,4,3,none"
date
