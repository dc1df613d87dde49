# Call 2 (nvidia-h200, call 1's machine): split_k_probe.py again with the rule's split CTAs on few weight stages (and the sweep over stage counts), then 32 and 8 requests (input 100-1024, output 512) with the split on and off, alternating.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
date +%T
echo "== split_k_probe"; timeout 240 python3 benchmarks/split_k_probe.py --rows 2 8 16 32 64 2>&1 | grep -v "^INFO"; date +%T
B="python3 bin/minivllm bench throughput --model benchmarks/configs/qwen3-0.6b --load-format dummy --seed 0 --input-len 100:1024 --output-len 512 --no-roofline"
for n in 32 8; do for split in 1 0 1 0; do
  echo "== $n requests, split $split"; MINIVLLM_HOPPER_GEMM_SPLIT_K=$split timeout 90 $B --num-prompts $n 2>&1 | grep "output tokens/s\|between tokens\|Error"
done; done; date +%T
