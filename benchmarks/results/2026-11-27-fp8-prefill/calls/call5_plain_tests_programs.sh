#!/usr/bin/env bash
# H100: the plain prefill kernel's GPU tests after the refactor into _attend_query_tile (bf16 and
# float32: every mixed-step reference case, graph padding, context splits, decodes in the prefill
# kernel); then the cached chunks' kernel at 1 and 2 programs an SM on the FP8 prefill cases.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
echo "== tests $(date +%T)"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -rf \
  -k "(test_kernel_equals_reference and mixed) or test_mixed_step_padding or (test_context_splits and not fp8) or (test_prefill_kernel_takes_decodes_too and not fp8)"
for per_sm in 2 1 2 1; do
  echo "== cached kernel at $per_sm programs an SM $(date +%T)"
  timeout 40 python3 -c "
import sys; sys.path.insert(0, 'benchmarks'); sys.argv = ['tune_attention.py', '--fp8', '--cudagraph', '--no-sweep', '--cases', 'prefill-16384-after-chunk,prefill-8192-after-8k']
import tune_attention
from minivllm.worker.attention import triton_attention
triton_attention.CACHED_PREFILL_PROGRAMS_PER_SM = $per_sm
tune_attention.main()" 2>&1 | grep -v SDPA
done
date
