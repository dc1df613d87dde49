#!/usr/bin/env bash
# H100: _cached_prefill_kernel (an FP8 step's chunks after a cached context on a few looping
# programs). Its tests (the large FP8 steps of test_fp8_cache and test_fp8_cached_chunks_kernel);
# then the prefill step's attention, this tree against the start's triton_attention.py
# (.devtmp/base = cbdb798) in CUDA graphs; then each launch alone (launch_costs.py).
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
echo "== tests $(date +%T)"
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -rf \
  -k "test_fp8_cached_chunks_kernel or (test_fp8_cache and large)"
echo "== tune_attention fp8 $(date +%T)"
timeout 200 python3 benchmarks/tune_attention.py --fp8 --cudagraph --no-sweep \
  --cases prefill-16384-after-chunk,prefill-16384xragged,prefill-8192-after-8k,prefill-32k \
  --baseline .devtmp/base/worker/attention/triton_attention.py
echo "== tune_attention bf16 $(date +%T)"
timeout 100 python3 benchmarks/tune_attention.py --cudagraph --no-sweep \
  --cases prefill-16384-after-chunk,prefill-16384xragged \
  --baseline .devtmp/base/worker/attention/triton_attention.py
echo "== launch_costs $(date +%T)"
timeout 150 python3 benchmarks/results/2026-11-27-fp8-prefill/launch_costs.py
date
