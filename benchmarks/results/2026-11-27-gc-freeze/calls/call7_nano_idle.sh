#!/usr/bin/env bash
# H100: nano-vllm's workload (bf16) with the heap frozen and not, alternating; then where the FP8
# 256-request run's GPU still idles over 200 decode steps, frozen.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
for freeze in 1 0 1 0; do
  echo "== nano bf16 GC_FREEZE=$freeze $(date +%T)"
  MINIVLLM_GC_FREEZE=$freeze REPS=2 timeout 150 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --nano 2>&1 | grep -E " rep |Error|error" | cut -c1-110
done
echo "== gpu_idle fp8 200 steps from the 21st $(date +%T)"
timeout 200 python3 benchmarks/gpu_idle/gpu_idle.py --skip 20 --steps 200 -- --model benchmarks/configs/qwen3-0.6b \
  --load-format dummy --num-prompts 256 --input-len 100:1024 --output-len 256 --kv-cache-dtype fp8 2>&1 \
  | grep -E "GPU_IDLE (200 steps|gap)|minivllm:" | head -12
date
