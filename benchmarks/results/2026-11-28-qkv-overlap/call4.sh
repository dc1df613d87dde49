# Call 4 (nvidia-h100-x1): step_timeline_probe.py, FP8 ragged, with and without the decode kernel's wait (a bound).
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
python3 benchmarks/step_timeline_probe.py --ragged
python3 benchmarks/step_timeline_probe.py --ragged --no-wait
python3 benchmarks/step_timeline_probe.py --ragged
