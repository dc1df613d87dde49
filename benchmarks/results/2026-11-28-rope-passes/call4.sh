# Call 4 (nvidia-h100-x1): where the FP8 workload's run-to-run spread comes from: 3 against 4 steps in flight, alternating, the output's token-time gaps printed whole; bf16 beside it.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
python3 -c "import ctypes,glob; [ctypes.CDLL(f) for f in glob.glob('/tmp/mvcache/kernels/**/*.so', recursive=True)]; print('prebuilt kernels load')" || rm -rf /tmp/mvcache/kernels
date +%T
for steps in 3 4 3 4; do
  MINIVLLM_STEPS_IN_FLIGHT=$steps REPS=3 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --fp8 2>&1 | grep " rep " | sed "s/^/steps $steps: /"; date +%T
done
REPS=3 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py 2>&1 | grep " rep "; date +%T
