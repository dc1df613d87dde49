# Call 10 (nvidia-h100-x1): fp8_decode.cu with MINIVLLM_FP8_DECODE_DESYNC (rotate by default): the GPU
# tests, the in-step probe for each mode, then the 256-request FP8 workload without and with rotation.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
date +%T; python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_fp8_decode.py 2>&1 | tail -4
t() { MINIVLLM_FP8_DECODE_DESYNC=$1 python3 benchmarks/step_timeline_probe.py --ragged 2>&1 | grep "^step\|^chain" | sed "s/^/$1 /"; }
date +%T; for mode in 0 rotate stagger 0 rotate stagger; do t $mode; done
date +%T
for mode in 0 rotate; do
  MINIVLLM_FP8_DECODE_DESYNC=$mode REPS=3 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --fp8 2>&1 | grep " rep " | cut -c1-80 | sed "s/^/$mode /"
  date +%T
done
