# Call 5 (nvidia-h200): `bench throughput` twice more (bf16 with the roofline, then FP8), to set bench's own figure beside run_phases.py's on one machine; then FP8 with 3 (default) and 4 steps in flight, alternating, 3 runs an engine.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; date +%T
B="python3 bin/minivllm bench"
W="--model benchmarks/configs/qwen3-0.6b --load-format dummy --seed 0 --input-len 100:1024 --output-len 256"
echo "== 256 bf16"; timeout 150 $B throughput $W --json $OUT/bf16.json 2>&1 | grep -v "^INFO\|it/s\]" | tail -6; date +%T
echo "== 256 fp8"; timeout 150 $B throughput $W --kv-cache-dtype fp8 --no-roofline --json $OUT/fp8.json 2>&1 | grep -v "^INFO\|it/s\]" | tail -3; date +%T
for case in 3 4 3 4; do
  date +%T; echo "== fp8, steps in flight $case"
  MINIVLLM_STEPS_IN_FLIGHT=$case REPS=3 timeout 100 python3 benchmarks/results/2026-11-28-row-layout-checks/run_phases.py --fp8 2>&1 | grep " rep \|Error" | sed 's/; the largest.*over 8 ms/; over 8 ms/'
done
date +%T
