#!/usr/bin/env bash
# H100: prompt_gemm.linear_add (o_proj and down_proj add into the residual stream in the product's
# epilogue; the next norm then reads the stream alone): test_prompt_gemm.py; its tilings against
# cuBLAS + add_rms_norm; the best one written into this machine's copy of worker/prompt_gemm.py
# (ADD_TILING); then the 256-request workload with every prompt kernel (MINIVLLM_PROMPT_GEMM=1)
# against the gate|up one alone (=silu), bf16 and FP8, alternating.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
echo "== tests $(date +%T)"
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_prompt_gemm.py -rf 2>&1 | tail -12
echo "== probe $(date +%T)"
timeout 100 python3 benchmarks/gated_gemm_probe.py --add --rows 8192 16384 | tee /tmp/add_probe.txt
best=$(grep "^best " /tmp/add_probe.txt | cut -d' ' -f2)
if [ -n "$best" ]; then
  python3 - "$best" <<'PY'
import re, sys
v = sys.argv[1].split(",")
tiling = "(" + ", ".join(v[:5]) + ", " + ("True" if v[5] == "1" else "False") + ")"
path = "worker/prompt_gemm.py"
src = re.sub(r"^ADD_TILING = .*$", "ADD_TILING = " + tiling, open(path).read(), flags=re.M)
open(path, "w").write(src)
print("ADD_TILING set to", tiling)
PY
fi
grep -n "^ADD_TILING" worker/prompt_gemm.py
E=benchmarks/results/2026-11-27-cdf-sampler/run_edges.py
t=120
for dt in bf16 fp8 bf16; do
  flag=$([ $dt = fp8 ] && echo --fp8)
  for g in 1 silu; do
    echo "== $dt PROMPT_GEMM=$g $(date +%T)"
    MINIVLLM_PROMPT_GEMM=$g REPS=3 timeout $t python3 $E $flag 2>&1 | grep " rep " | cut -c1-100
    t=60
  done
done
date
