# Call 11 (nvidia-h100-x1): the 256-request FP8 workload, the first wave's heads staggered against in step.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
for mode in stagger 0 stagger 0; do
  MINIVLLM_FP8_DECODE_DESYNC=$mode REPS=3 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --fp8 2>&1 | grep " rep " | cut -c1-80 | sed "s/^/$mode /"
  date +%T
done
