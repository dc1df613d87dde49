# Call 4 (nvidia-h100-x1): why FP8 runs fall in two groups (~1,620-1,650 and ~1,675-1,700 ms) while bf16's hold within 2%: each run split into its prompt phase and its decode steps (run_phases.py).
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
for kind in fp8 bf16 fp8; do
  date +%T
  flag=""; [ $kind = fp8 ] && flag="--fp8"
  REPS=5 timeout 120 python3 benchmarks/results/2026-11-28-row-layout-checks/run_phases.py $flag 2>&1 | grep " rep \|Error"
done
date +%T
