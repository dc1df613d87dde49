# Call 2 (nvidia-h100-x1): what each part of linear_rope's FP8 K/V store costs (qkv alone and in a step, stores left out); both workloads at the session's start tree.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
python3 -c "import ctypes,glob; [ctypes.CDLL(f) for f in glob.glob('/tmp/mvcache/kernels/**/*.so', recursive=True)]; print('prebuilt kernels load')" || rm -rf /tmp/mvcache/kernels
date +%T
python3 benchmarks/rope_epilogue_probe.py --rounds 2; date +%T
for c in "--fp8" "" "--fp8" ""; do
  REPS=3 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py $c 2>&1 | grep " rep " | cut -c1-90; date +%T
done
