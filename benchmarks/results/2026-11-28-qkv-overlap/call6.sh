# Call 6 (nvidia-h100-x1): step_timeline_probe.py, FP8 ragged: each layer's own weights and cache, or shared.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
for round in 1 2; do
  python3 benchmarks/step_timeline_probe.py --ragged 2>&1 | grep -v "CTAs running"
  python3 benchmarks/step_timeline_probe.py --ragged --shared-weights 2>&1 | grep -v "CTAs running"
  python3 benchmarks/step_timeline_probe.py --ragged --shared-cache 2>&1 | grep -v "CTAs running"
  python3 benchmarks/step_timeline_probe.py --ragged --shared-weights --shared-cache 2>&1 | grep -v "CTAs running"
done
