#!/usr/bin/env bash
# H100: the full tests/gpu/test_triton_attention.py on main cbdb798 (FP8 caches with bfloat16
# scales; its FP8 tests were last verified only under the CPU interpreter), then
# test_gpu_kv_offload.py (the offload tier's FP8 block size) in the time left.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
echo "== test_triton_attention $(date +%T)"
timeout 450 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -rf --durations=5 2>&1 | tail -40
echo "== test_gpu_kv_offload $(date +%T)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_kv_offload.py -rf 2>&1 | tail -15
date
