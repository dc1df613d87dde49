# Call 5 (nvidia-h100-x1, a fresh machine): bf16, 3 runs (the machine's GPU-bound pace); five traced FP8 runs with host_canary.py beside them, now with its memory probe (32 MiB, a byte a cache line, every 20 ms); PSI before and after; then FP8 with 3 and 4 steps in flight, 4 runs an engine, untraced.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
psi() { for f in cpu memory io; do echo "psi $f: $(tr '\n' ' ' < /proc/pressure/$f 2>/dev/null)"; done; }
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket|L3" ; date +%T
REPS=3 timeout 100 python3 benchmarks/results/2026-11-28-row-layout-checks/run_phases.py 2>&1 | grep " rep \|Error" | sed 's/; the largest.*over 8 ms/; over 8 ms/'
mkdir -p $OUT/trace; export TIMELINE_DIR=$OUT/trace
date +%T; head -1 /proc/stat; psi
python3 benchmarks/timeline/host_canary.py --seconds 150 > $OUT/canary.txt 2>&1 &
CANARY=$!
PYTHONPATH=$(pwd)/benchmarks/timeline:$PYTHONPATH REPS=5 timeout 140 python3 benchmarks/results/2026-11-28-row-layout-checks/run_phases.py --fp8 2>&1 | grep " rep \|Error\|Traceback"
kill -INT $CANARY; wait $CANARY; cat $OUT/canary.txt
date +%T; head -1 /proc/stat; psi
unset TIMELINE_DIR
for case in 3 4; do
  date +%T; echo "== fp8, steps in flight $case"
  MINIVLLM_STEPS_IN_FLIGHT=$case REPS=4 timeout 100 python3 benchmarks/results/2026-11-28-row-layout-checks/run_phases.py --fp8 2>&1 | grep " rep \|Error" | sed 's/; the largest.*over 8 ms/; over 8 ms/'
done
date +%T
