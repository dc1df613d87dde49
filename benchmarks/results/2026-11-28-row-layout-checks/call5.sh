# Call 5 (nvidia-h100-x1): the FP8 runs' long steps (20-28 ms, call 4) against the garbage collector's passes in every process (gcprobe of the twenty-fourth session prints each pass over 2 ms with its time).
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
export PYTHONPATH=$(pwd)/benchmarks/results/2026-11-27-gc-freeze/gcprobe:$PYTHONPATH
for kind in fp8 fp8; do
  date +%T
  REPS=5 timeout 120 python3 benchmarks/results/2026-11-28-row-layout-checks/run_phases.py --fp8 2>&1 | grep " rep \|Error\|GCPROBE"
done
date +%T
