# Call 4 (nvidia-h200, the tree of call 3): test_triton_attention.py and test_hopper_prefill.py on an H200, in one pytest run.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; date +%T
timeout 540 python3 -m pytest -q -n 8 -p no:cacheprovider --durations=8 tests/gpu/test_triton_attention.py tests/gpu/test_hopper_prefill.py 2>&1 | grep -v "^INFO\|PytestBenchmarkWarning\|warner(" | tail -25; date +%T
