# Call 9 (nvidia-h100-x1): step_timeline_probe.py, FP8 ragged: staggered first waves against none, interleaved.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
t() { python3 benchmarks/step_timeline_probe.py --ragged "$@" 2>&1 | grep "^NVIDIA\|^step\|^chain"; }
for round in 1 2; do t; t --stagger 500; t --stagger 1000; done
