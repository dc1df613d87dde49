#!/usr/bin/env bash
# H100: FP8 read ceilings with the scales stored otherwise (ceiling_scales.py); the prompt phase's
# kernels (22 steps from the measured run's first), bf16 and FP8.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
echo "== ceiling_scales $(date +%T)"
timeout 240 python3 benchmarks/results/2026-11-27-host-gaps/ceiling_scales.py 2>&1 | tail -12
W="--model benchmarks/configs/qwen3-0.6b --load-format dummy --num-prompts 256 --input-len 100:1024 --output-len 256"
for dt in fp8 auto; do
  echo "== prompt phase $dt $(date +%T)"
  timeout 150 python3 benchmarks/gpu_idle/gpu_idle.py --steps 22 -- $W --kv-cache-dtype $dt 2>&1 | grep -E "GPU_IDLE (kernel|steps|22 steps|   )|tok/s" | cut -c1-200 | head -40
done
date
