#!/usr/bin/env bash
# H100: where a decode step goes now (20 steps from the 101st) and the prompt phase (22 steps), bf16 and FP8.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
W="--model benchmarks/configs/qwen3-0.6b --load-format dummy --num-prompts 256 --input-len 100:1024 --output-len 256"
for dt in auto fp8; do
  echo "== decode window $dt $(date +%T)"
  timeout 150 python3 benchmarks/gpu_idle/gpu_idle.py --skip 100 --steps 20 -- $W --kv-cache-dtype $dt 2>&1 | grep -E "GPU_IDLE (kernel|steps|20 steps| +[0-9])|minivllm:" | head -24
done
for dt in auto fp8; do
  echo "== prompt phase $dt $(date +%T)"
  timeout 150 python3 benchmarks/gpu_idle/gpu_idle.py --steps 22 -- $W --kv-cache-dtype $dt 2>&1 | grep -E "GPU_IDLE (kernel|steps|22 steps| +[0-9])|minivllm:" | head -30
done
date
