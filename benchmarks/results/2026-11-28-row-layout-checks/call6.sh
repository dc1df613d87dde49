# Call 6 (nvidia-h100-x1): the FP8 runs' long steps from inside the engine: benchmarks/timeline's marks (entry and exit of the scheduler's, executor's and worker's calls, every process) over five runs of run_phases.py; traces to $OUT/trace.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
mkdir -p $OUT/trace; export TIMELINE_DIR=$OUT/trace
export PYTHONPATH=$(pwd)/benchmarks/timeline:$PYTHONPATH
date +%T
REPS=5 timeout 120 python3 benchmarks/results/2026-11-28-row-layout-checks/run_phases.py --fp8 2>&1 | grep " rep \|Error\|Traceback"
date +%T; ls -la $OUT/trace
