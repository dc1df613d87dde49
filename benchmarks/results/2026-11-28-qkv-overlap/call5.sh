# Call 5 (nvidia-h100-x1): step_timeline_probe.py, FP8 ragged, the qkv GEMM's CTA ends by head kind.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
python3 benchmarks/step_timeline_probe.py --ragged 2>&1 | grep -v "CTAs running"
python3 benchmarks/step_timeline_probe.py --context 700 2>&1 | grep -v "CTAs running"
