# Call 4 (nvidia-h200, a fresh machine): this chip's read ceilings for the decode caches' patterns; the bf16 decode kernel's shapes swept on the 256-request workload's decode steps, and the FP8 kernel's rate; then bf16 and FP8 alternating (2 engines each, 3 runs an engine) for target 3's ratio on an H200.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; date +%T
timeout 120 python3 benchmarks/read_ceilings.py; date +%T
timeout 200 python3 benchmarks/tune_attention.py --cases decode-256x700,decode-256xragged --cudagraph --top 3; date +%T
timeout 100 python3 benchmarks/tune_attention.py --fp8 --cases decode-256x700,decode-256xragged --cudagraph --no-sweep; date +%T
for case in bf16 fp8 bf16 fp8; do
  flag=""; [ $case = fp8 ] && flag=--fp8
  date +%T; echo "== $case"
  REPS=3 timeout 100 python3 benchmarks/results/2026-11-28-row-layout-checks/run_phases.py $flag 2>&1 | grep " rep \|Error" | sed 's/; the largest.*over 8 ms/; over 8 ms/'
done
date +%T
