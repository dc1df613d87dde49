# Call 7 (nvidia-h100-x1): call 6's traces put the long decode steps on the host (Scheduler.schedule 12-15 ms, the worker's and the frontend's calls slowed in the same windows). Does a third step queued ahead (MINIVLLM_STEPS_IN_FLIGHT=4 against the default 3) ride them out? Alternating, 4 runs an engine; /proc/stat's cpu line before and after (steal time).
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nproc; head -1 /proc/stat
for case in "fp8 3" "fp8 4" "bf16 4" "fp8 3" "fp8 4" "bf16 3"; do
  set -- $case; flag=""; [ $1 = fp8 ] && flag="--fp8"
  date +%T; echo "== $1, steps in flight $2"
  MINIVLLM_STEPS_IN_FLIGHT=$2 REPS=4 timeout 100 python3 benchmarks/results/2026-11-28-row-layout-checks/run_phases.py $flag 2>&1 | grep " rep \|Error" | sed 's/; the largest.*over 8 ms/; over 8 ms/'
done
date +%T; head -1 /proc/stat
