# Call 3 (nvidia-h100-x1): linear_rope pulling the sectors its FP8 K/V store writes in part into L2 first: its GPU tests, the probe (with the fill left out, and the bounds), the FP8 workload against the start tree's hopper_gemm.cu, alternating.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
python3 -c "import ctypes,glob; [ctypes.CDLL(f) for f in glob.glob('/tmp/mvcache/kernels/**/*.so', recursive=True)]; print('prebuilt kernels load')" || rm -rf /tmp/mvcache/kernels
date +%T
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_hopper_gemm.py -k rope 2>&1 | tail -2; date +%T
python3 benchmarks/rope_epilogue_probe.py --rounds 2 --caches fp8 --variants "as built,no L2 fill,no L2 fill of values,no value bytes,no scales,values as one row"; date +%T
cp worker/hopper_gemm.cu /tmp/filled.cu
for tree in filled start filled start; do
  if [ $tree = start ]; then cp .devtmp/mvc/start_hopper_gemm.cu worker/hopper_gemm.cu; else cp /tmp/filled.cu worker/hopper_gemm.cu; fi
  REPS=3 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --fp8 2>&1 | grep " rep " | cut -c1-80 | sed "s/^/$tree /"; date +%T
done
cp /tmp/filled.cu worker/hopper_gemm.cu
