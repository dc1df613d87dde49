#!/usr/bin/env bash
# 2x H200: the two-GPU test files not yet run with linear_rope on (PP, PD-disagg, TP whole, PD-NCCL).
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date; git log --oneline -1 2>/dev/null || true
python3 -c "import fastapi, openai, zmq, msgspec; print('wheels', fastapi.__version__, openai.__version__)"
for f in test_gpu_pipeline_parallel test_gpu_pd_disagg test_gpu_tensor_parallel test_gpu_pd_nccl; do
  echo "== $f $(date +%T)"
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/$f.py --durations=3 2>&1 | tail -15
done
date
