#!/usr/bin/env bash
# H100: an FP8 prompt step's cached chunks' launch first, the fresh prompts' launch beside it (PDL;
# its last program waits for the first), the fresh launch without the cache loops. Tests: the new
# join test, the FP8 step tests (new kernels), test_fp8_cache's other cases (owed on this tree
# since the prefill body was shared); a negative control (the join test with the last program's
# wait removed must fail); then the prefill steps against HEAD's triton_attention.py
# (.devtmp/base = 2b1e2b7) and with MINIVLLM_PREFILL_JOINS=0; then the fresh launch's shapes.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
T=tests/gpu/test_triton_attention.py
echo "== tests $(date +%T)"
timeout 300 python3 -m pytest -q -p no:cacheprovider $T -rf \
  -k "test_fp8_step_launches or test_fp8_cached_chunks_kernel or test_fp8_cache"
echo "== negative control: no wait in the fresh launch's last program $(date +%T)"
F=worker/attention/triton_attention.py; cp $F /tmp/ta.bak
python3 - <<'PY'
p = "worker/attention/triton_attention.py"; s = open(p).read()
old = "        if pid == tl.num_programs(0) - 1:\n            gdc_wait()\n"
assert s.count(old) == 1; open(p, "w").write(s.replace(old, "        pass\n"))
PY
timeout 90 python3 -m pytest -q -p no:cacheprovider $T -rf -k "test_fp8_step_launches" 2>&1 | tail -6
cp /tmp/ta.bak $F
B=.devtmp/base/worker/attention/triton_attention.py
C=prefill-16384-after-chunk,prefill-16384xragged,prefill-8192-after-8k
for r in 1 2; do
  echo "== tune fp8, round $r $(date +%T)"
  timeout 100 python3 benchmarks/tune_attention.py --fp8 --cudagraph --no-sweep --cases $C --baseline $B
  echo "== tune fp8, MINIVLLM_PREFILL_JOINS=0, round $r $(date +%T)"
  MINIVLLM_PREFILL_JOINS=0 timeout 60 python3 benchmarks/tune_attention.py --fp8 --cudagraph --no-sweep --cases $C
done
echo "== fresh launch shapes $(date +%T)"
for c in prefill-16384xragged prefill-16384-after-chunk; do
  timeout 80 python3 benchmarks/tune_attention.py --fp8 --cudagraph --fresh-sweep --cases $c --top 7 \
    --configs "128,32,8,3,128;128,64,8,4,128;128,64,8,3,128;128,32,8,4,128;64,64,4,3,none;128,64,8,2,128;64,32,4,3,none"
done
date
