# Call 2 (nvidia-h100-x1): target 3 on the final tree: the 256-request workload, bf16 and FP8 alternating on one machine, REPS=3 each, twice.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for kind in bf16 fp8 bf16 fp8; do
  flag=""; [ $kind = fp8 ] && flag="--fp8"
  REPS=3 timeout 110 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py $flag 2>&1 | grep " rep \|Error" | cut -c1-80
  date +%T
done
