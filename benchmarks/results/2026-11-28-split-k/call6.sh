# Call 6 (nvidia-h200, the final tree): where a few-sequence decode step's time goes on an H200 (profile_step.py at 8 and 32 sequences of 700-token contexts), for the nano-vllm workload's low-concurrency tail.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
date +%T
for b in 8 32; do echo "== batch $b"; timeout 100 python3 benchmarks/profile_step.py --batch $b --context 700 --no-prefill 2>&1 | grep -v "^INFO" | head -45; date +%T; done
