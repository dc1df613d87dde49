# Call 2 (nvidia-h100-x1): step_timeline_probe.py, FP8 ragged and 700.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
python3 benchmarks/step_timeline_probe.py --ragged
python3 benchmarks/step_timeline_probe.py --context 700
