# Call 1 (nvidia-h100-x1): the owed test_ops.py (after 3edd48f); the persistent Hopper prefill kernel against the one-program-per-item kernel (.devtmp/prefill_old.cu = hopper_prefill.cu at 010e378) and Triton, in CUDA graphs; its tests; then kernel_boundary_probe.py.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; nvcc --version | tail -2; date +%T
timeout 120 python3 -m pytest -q tests/gpu/test_ops.py -p no:cacheprovider 2>&1 | tail -2; date +%T
timeout 240 python3 benchmarks/hopper_variants.py --cudagraph --rounds 3 --variant old=.devtmp/prefill_old.cu --variant new=worker/attention/hopper_prefill.cu --cases prefill-8192x562+ascending,prefill-16384xragged+ascending,prefill-16384xragged+descending,prefill-16384-after-chunk+ascending,prefill-1x4096+ascending,prefill-4x4096+ascending,prefill-1x16384+ascending,prefill-1x16384+descending,prefill-32k+ascending,prefill-1x16384+scattered; date +%T
timeout 240 python3 -m pytest -q -n 4 tests/gpu/test_hopper_prefill.py -p no:cacheprovider 2>&1 | tail -4; date +%T
timeout 200 python3 benchmarks/kernel_boundary_probe.py; date +%T
