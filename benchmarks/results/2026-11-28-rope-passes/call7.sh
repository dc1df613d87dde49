# Call 7 (nvidia-h100-x1): FP8 values stored as rows (the tree after 1291f35): its CUDA and store tests, the FP8 workload against the start tree (1291f35, carried as .devtmp/mvc/start_tree), alternating; bf16; then test_gpu_engine's and test_triton_attention's FP8 tests as time allows.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
python3 -c "import ctypes,glob; [ctypes.CDLL(f) for f in glob.glob('/tmp/mvcache/kernels/**/*.so', recursive=True)]; print('prebuilt kernels load')" || rm -rf /tmp/mvcache/kernels
mkdir -p /tmp/start-path && ln -sfn "$(pwd)/.devtmp/mvc/start_tree" /tmp/start-path/minivllm
date +%T
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_decode.py 2>&1 | tail -3; date +%T
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_hopper_gemm.py -k rope 2>&1 | tail -3; date +%T
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ops.py -k "stores_kv or fp8" 2>&1 | tail -3; date +%T
for tree in rows start rows start; do
  if [ $tree = start ]; then
    (cd .devtmp/mvc/start_tree && PYTHONPATH=/tmp/site:/tmp/start-path REPS=3 timeout 120 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --fp8 2>&1 | grep " rep " | cut -c1-80 | sed "s/^/$tree /")
  else
    REPS=3 timeout 120 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --fp8 2>&1 | grep " rep " | cut -c1-80 | sed "s/^/$tree /"
  fi
  date +%T
done
REPS=3 timeout 100 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py 2>&1 | grep " rep " | cut -c1-80 | sed "s/^/rows /"; date +%T
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py -k fp8 2>&1 | tail -3; date +%T
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -k fp8 -x 2>&1 | tail -4; date +%T
