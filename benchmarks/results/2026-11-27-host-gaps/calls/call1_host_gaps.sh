#!/usr/bin/env bash
# H100: the EngineCore's long loop iterations (probe/) over whole FP8 and bf16 runs, and an FP8
# gpu_idle window of 200 decode steps from the 21st with the worker's host calls and the probe.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
P=$(pwd)/benchmarks/results/2026-11-27-host-gaps/probe
for mode in fp8 bf16; do
  flag=""; [ $mode = fp8 ] && flag="--fp8"
  echo "== $mode run_edges, probe $(date +%T)"
  PYTHONPATH=$P:$PYTHONPATH REPS=3 timeout 200 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py $flag 2>&1 | grep -E " rep |HOSTGAP|Error|error" | cut -c1-400
done
W="--model benchmarks/configs/qwen3-0.6b --load-format dummy --num-prompts 256 --input-len 100:1024 --output-len 256 --kv-cache-dtype fp8"
echo "== fp8 gpu_idle 200 steps from the 21st, probe $(date +%T)"
PYTHONPATH=$P:$PYTHONPATH MINIVLLM_GPU_IDLE_STEPS=200 MINIVLLM_GPU_IDLE_SKIP=20 timeout 200 python3 -m minivllm.frontend.cli bench throughput $W 2>&1 | grep -E "GPU_IDLE|HOSTGAP|tok/s|Error|error" | grep -v "GPU_IDLE   " | cut -c1-300
date
