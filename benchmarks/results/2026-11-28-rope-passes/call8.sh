# Call 8 (nvidia-h100-x1): FP8 values as rows after call 7's fix (the rotating decode kernel's write_kv_heads call kept a removed argument, so no engine started): test_gpu_engine's FP8 tests, the bad-layout test, the FP8 workload against the start tree (1291f35), alternating.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
mkdir -p /tmp/start-path && ln -sfn "$(pwd)/.devtmp/mvc/start_tree" /tmp/start-path/minivllm
date +%T
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py -k fp8 2>&1 | tail -3; date +%T
timeout 30 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_decode.py -k bad_layout 2>&1 | tail -1
for tree in rows start rows; do
  if [ $tree = start ]; then
    (cd .devtmp/mvc/start_tree && PYTHONPATH=/tmp/site:/tmp/start-path REPS=3 timeout 80 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --fp8 2>&1 | grep " rep \|Error" | cut -c1-80 | sed "s/^/$tree /")
  else
    REPS=3 timeout 80 python3 benchmarks/results/2026-11-27-cdf-sampler/run_edges.py --fp8 2>&1 | grep " rep \|Error" | cut -c1-80 | sed "s/^/$tree /"
  fi
  date +%T
done
