# Call 5 (nvidia-h200-x2, the tree of calls 3-4): the two-GPU test files not run on an H200 since the H100s went (tensor and pipeline parallel), and test_hopper_prefill.py's two-GPU case.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
run() { local t=$1; shift; date +%T; echo "== $*"; timeout $t python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | grep -E "passed|failed|error|FAILED|ERROR|skipped" | tail -8; }
run 90 tests/gpu/test_hopper_prefill.py -k test_tensor_parallel_ranks_run_it
run 230 tests/gpu/test_gpu_tensor_parallel.py
run 200 tests/gpu/test_gpu_pipeline_parallel.py
date +%T
