# Call 8 (nvidia-h100-x1, call 7's machine, still warm): nano-vllm's workload on the final tree (target 2's second half, 21,500 output tok/s), bf16, 3 runs.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
date +%T
REPS=3 timeout 150 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --nano 2>&1 | grep " rep \|Error" | cut -c1-90
date +%T
