# Call 1 (nvidia-h200): the Hopper GEMM's split of K for few tokens: test_hopper_gemm.py with its new split tests, then split_k_probe.py (each projection and a layer's chain at 2-128 rows, split and whole), then test_gpu_engine.py.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; date +%T
echo "== test_hopper_gemm"; timeout 200 python3 -m pytest -q -x -n 4 -p no:cacheprovider tests/gpu/test_hopper_gemm.py 2>&1 | tail -6; date +%T
echo "== split_k_probe"; timeout 220 python3 benchmarks/split_k_probe.py 2>&1 | grep -v "^INFO"; date +%T
echo "== test_gpu_engine"; timeout 150 python3 -m pytest -q -x -n 4 -p no:cacheprovider tests/gpu/test_gpu_engine.py 2>&1 | tail -4; date +%T
