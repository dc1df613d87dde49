# Call 7 (nvidia-h200): after the 2-D map encoder moved into hopper_ptx.cuh (hopper_gemm.cu and hopper_prefill.cu rebuilt): test_hopper_gemm.py and test_hopper_prefill.py whole, 4 xdist workers; the multicast probe once more at 256 rows on the shared encoder.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nvidia-smi --query-gpu=name --format=csv,noheader; date +%T
timeout 280 python3 -m pytest -q -n 4 -p no:cacheprovider tests/gpu/test_hopper_gemm.py tests/gpu/test_hopper_prefill.py 2>&1 | tail -4; date +%T
timeout 100 python3 benchmarks/multicast_copy_probe.py --rows 256 | head -8; date +%T
