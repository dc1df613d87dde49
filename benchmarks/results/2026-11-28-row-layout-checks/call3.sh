# Call 3 (nvidia-h100-x1): the two test files call 1's 60 s limit cut (test_cuda_graphs, test_gpu_kv_offload); then the 256-request workload with whole lines (call 2 cut them at 80 characters), to see where a slow FP8 run's time goes: its step gaps' median and largest.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
date +%T
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graphs.py tests/gpu/test_gpu_kv_offload.py 2>&1 | tail -5
for kind in fp8 bf16 fp8; do
  date +%T
  flag=""; [ $kind = fp8 ] && flag="--fp8"
  REPS=4 timeout 110 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py $flag 2>&1 | grep " rep \|Error"
done
date +%T
