# Call 2 (nvidia-h100-x1, call 1's machine): test_gpu_engine.py whole (call 1's 220 s limit cut it), in 4 xdist workers; then five FP8 runs of run_phases.py traced with benchmarks/timeline's marks and host_canary.py beside them, traces to $OUT/trace.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
date +%T; echo "== tests/gpu/test_gpu_engine.py -n 4"
timeout 330 python3 -m pytest -q -p no:cacheprovider -n 4 tests/gpu/test_gpu_engine.py 2>&1 | grep -E "passed|failed|error|FAILED|ERROR" | tail -8
mkdir -p $OUT/trace; export TIMELINE_DIR=$OUT/trace
date +%T; head -1 /proc/stat
python3 benchmarks/timeline/host_canary.py --seconds 150 > $OUT/canary.txt 2>&1 &
CANARY=$!
PYTHONPATH=$(pwd)/benchmarks/timeline:$PYTHONPATH REPS=5 timeout 140 python3 benchmarks/results/2026-11-28-row-layout-checks/run_phases.py --fp8 2>&1 | grep " rep \|Error\|Traceback"
kill -INT $CANARY; wait $CANARY; cat $OUT/canary.txt
date +%T; head -1 /proc/stat; ls $OUT/trace | head
