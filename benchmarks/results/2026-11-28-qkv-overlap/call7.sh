# Call 7 (nvidia-h100-x1): step_timeline_probe.py, FP8 ragged, the first wave's first blocks prefetched into L2.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
t() { python3 benchmarks/step_timeline_probe.py --ragged "$@" 2>&1 | grep -v "CTAs running"; }
t
t --prefetch 8
t --prefetch 16
t --prefetch 8 --prefetch-at mlp
t --prefetch 16 --prefetch-at mlp
t
