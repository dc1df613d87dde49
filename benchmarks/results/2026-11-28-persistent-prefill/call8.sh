# Call 8 (nvidia-h200): multicast_copy_probe.py at 256 and 128 rows with the lean release (one arrival per CTA and stage, as CUTLASS's pipelines) beside the per-warp one; then test_gpu_engine.py whole (4 xdist workers) on the shared map encoder.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nvidia-smi --query-gpu=name --format=csv,noheader; date +%T
timeout 120 python3 benchmarks/multicast_copy_probe.py --rows 256; date +%T
timeout 100 python3 benchmarks/multicast_copy_probe.py --rows 128; date +%T
timeout 240 python3 -m pytest -q -n 4 -p no:cacheprovider tests/gpu/test_gpu_engine.py 2>&1 | tail -3; date +%T
