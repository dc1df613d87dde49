# Call 8 (nvidia-h100-x1): step_timeline_probe.py, FP8 ragged, the first wave's CTAs staggered after their wait.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
t() { python3 benchmarks/step_timeline_probe.py --ragged "$@" 2>&1 | grep -v "CTAs running\|qkv GEMM\|o projection\|globaltimer"; }
t
t --stagger 250
t --stagger 500
t
