# Call 3 (nvidia-h200: the H100s are no longer lent): the issue-14 workloads through `minivllm bench` as a user runs them, on tree 010e378's engine: the 256-request workload in bf16 (with the roofline: this H200's copy bandwidth and matmul rate) and FP8, nano-vllm's workload, and batch-1 latency.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,memory.total --format=csv,noheader; date +%T
B="python3 bin/minivllm bench"
W="--model benchmarks/configs/qwen3-0.6b --load-format dummy --seed 0 --input-len 100:1024"
echo "== 256 bf16"; timeout 150 $B throughput $W --output-len 256 --json $OUT/bf16.json 2>&1 | grep -v "^INFO\|it/s\]" | tail -8; date +%T
echo "== 256 fp8"; timeout 150 $B throughput $W --output-len 256 --kv-cache-dtype fp8 --no-roofline --json $OUT/fp8.json 2>&1 | grep -v "^INFO\|it/s\]" | tail -4; date +%T
echo "== nano bf16"; timeout 150 $B throughput $W --output-len 100:1024 --temperature 0.6 --json $OUT/nano.json 2>&1 | grep -v "^INFO\|it/s\]" | tail -8; date +%T
echo "== latency"; timeout 120 $B latency --model benchmarks/configs/qwen3-0.6b --load-format dummy --input-len 128 --output-len 128 --json $OUT/latency.json 2>&1 | grep -v "^INFO\|it/s\]" | tail -4; date +%T
