#!/usr/bin/env bash
# 2x H200 (or H100): tests/gpu/test_gpu_pd_nccl.py, whose FP8-packed rows changed with the bfloat16
# scales (owed since the last session).
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi -L; date
echo "== test_gpu_pd_nccl $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_pd_nccl.py -rf
date
