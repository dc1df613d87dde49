# Call 1 (nvidia-h100-x1): the GPU tests owed on the FP8 row layout (11af4ed): test_fp8_decode (its source hash changed), every Triton FP8 attention test (in 8 pytest-xdist workers: most of their time is Triton compiling), test_gpu_engine's FP8 tests, test_prompt_gemm, test_cuda_graphs, test_gpu_kv_offload.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
python3 -c "import ctypes,glob; [ctypes.CDLL(f) for f in glob.glob('/tmp/mvcache/kernels/**/*.so', recursive=True)]; print('prebuilt kernels load')" || rm -rf /tmp/mvcache/kernels
WORKERS="-n 8"; python3 -c "import xdist" 2>/dev/null || WORKERS=""; echo "xdist: '$WORKERS'"
run() { local t=$1; shift; date +%T; echo "== $*"; timeout $t python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | grep -E "passed|failed|error|FAILED|ERROR" | tail -8; }
run 90 tests/gpu/test_fp8_decode.py
run 240 tests/gpu/test_triton_attention.py -k fp8 $WORKERS
run 150 tests/gpu/test_gpu_engine.py -k fp8
run 60 tests/gpu/test_prompt_gemm.py
run 60 tests/gpu/test_cuda_graphs.py tests/gpu/test_gpu_kv_offload.py
date +%T
