# Call 1 (nvidia-h100-x1): the GPU tests owed on bce9241 (Triton's stride_v_dim removed): the whole of test_triton_attention.py (8 pytest-xdist workers) and test_ops.py; then test_gpu_engine.py whole.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
python3 -c "import ctypes,glob; [ctypes.CDLL(f) for f in glob.glob('/tmp/mvcache/kernels/**/*.so', recursive=True)]; print('prebuilt kernels load')" || rm -rf /tmp/mvcache/kernels
git log -1 --format='tree: %h %s' 2>/dev/null; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; nproc
WORKERS="-n 8"; python3 -c "import xdist" 2>/dev/null || WORKERS=""; echo "xdist: '$WORKERS'"
run() { local t=$1; shift; date +%T; echo "== $*"; timeout $t python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | grep -E "passed|failed|error|FAILED|ERROR" | tail -8; }
run 300 tests/gpu/test_triton_attention.py $WORKERS
run 60 tests/gpu/test_ops.py
run 220 tests/gpu/test_gpu_engine.py
date +%T
