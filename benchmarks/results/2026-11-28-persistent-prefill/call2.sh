# Call 2 (call 1's H200, warm): the prefill kernels side by side again (the old source copied beside hopper_prefill.cu, for its include); then the 256-request workload in bf16 with the Hopper kernel taking every prompt step of 2,048+ tokens (MIN_SEQ_LEN 0) against the rule as it is (8,192: Triton takes this workload's steps), alternating, 3 runs an engine.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
cp .devtmp/prefill_old.cu worker/attention/prefill_old.cu; date +%T
timeout 240 python3 benchmarks/hopper_variants.py --cudagraph --rounds 3 --variant old=worker/attention/prefill_old.cu --variant new=worker/attention/hopper_prefill.cu --cases prefill-8192x562+ascending,prefill-16384xragged+ascending,prefill-16384xragged+descending,prefill-16384-after-chunk+ascending,prefill-1x4096+ascending,prefill-4x4096+ascending,prefill-1x16384+ascending,prefill-1x16384+descending,prefill-32k+ascending,prefill-1x16384+scattered; date +%T
rm worker/attention/prefill_old.cu
for rule in 8192 0 8192 0; do
  sed -i "s/^MIN_SEQ_LEN = .*/MIN_SEQ_LEN = $rule/" worker/attention/hopper_prefill.py
  date +%T; echo "== bf16, MIN_SEQ_LEN $rule"
  REPS=3 timeout 100 python3 benchmarks/results/2026-11-28-row-layout-checks/run_phases.py 2>&1 | grep " rep \|Error" | sed 's/; the largest.*over 8 ms/; over 8 ms/'
done
date +%T
