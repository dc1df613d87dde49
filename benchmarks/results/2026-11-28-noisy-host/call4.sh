# Call 4 (nvidia-h200-x2): the two-GPU test owed since the FP8 row layout (test_gpu_pd_nccl.py), and the PD proxy test beside it (test_gpu_pd_disagg.py).
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
run() { local t=$1; shift; date +%T; echo "== $*"; timeout $t python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | grep -E "passed|failed|error|FAILED|ERROR|skipped" | tail -8; }
run 240 tests/gpu/test_gpu_pd_nccl.py
run 240 tests/gpu/test_gpu_pd_disagg.py
date +%T
