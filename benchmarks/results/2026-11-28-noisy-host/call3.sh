# Call 3 (nvidia-h100-x1, call 1's machine, whose FP8 runs had long steps in call 2): the canary now also marks slow 10 ms windows (its work's median over 2x) and slow page faults (a fresh 256 KiB), and reports /proc/vmstat's stall counters; five traced FP8 runs beside it, with PSI and THP settings before and after. Then FP8 with 3 (default) and 4 steps in flight alternating, 4 runs an engine, untraced.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
mkdir -p $OUT/trace; export TIMELINE_DIR=$OUT/trace
psi() { for f in cpu memory io; do echo "psi $f: $(tr '\n' ' ' < /proc/pressure/$f 2>/dev/null)"; done; }
date +%T; head -1 /proc/stat; psi; cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag 2>&1
python3 benchmarks/timeline/host_canary.py --seconds 150 > $OUT/canary.txt 2>&1 &
CANARY=$!
PYTHONPATH=$(pwd)/benchmarks/timeline:$PYTHONPATH REPS=5 timeout 140 python3 benchmarks/results/2026-11-28-row-layout-checks/run_phases.py --fp8 2>&1 | grep " rep \|Error\|Traceback"
kill -INT $CANARY; wait $CANARY; cat $OUT/canary.txt
date +%T; head -1 /proc/stat; psi
unset TIMELINE_DIR
for case in 3 4 3 4; do
  date +%T; echo "== fp8, steps in flight $case"
  MINIVLLM_STEPS_IN_FLIGHT=$case REPS=4 timeout 100 python3 benchmarks/results/2026-11-28-row-layout-checks/run_phases.py --fp8 2>&1 | grep " rep \|Error" | sed 's/; the largest.*over 8 ms/; over 8 ms/'
done
date +%T
