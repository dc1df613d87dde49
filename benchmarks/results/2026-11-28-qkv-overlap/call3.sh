# Call 3 (nvidia-h100-x1): step_timeline_probe.py with the qkv GEMM's CTA ends, FP8 ragged.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
python3 benchmarks/step_timeline_probe.py --ragged
