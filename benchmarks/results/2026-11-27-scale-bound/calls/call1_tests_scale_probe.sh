#!/usr/bin/env bash
# H100: test_triton_attention.py's non-FP8 tests, part 1 (owed since the prefill body became
# _attend_query_tile), then the FP8 decode kernel with every scale read from one place (stride 0:
# an L2 hit), against the real strides: what the scales' scattered reads cost the kernel.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
echo "== tests part 1 $(date +%T)"
timeout 340 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -rf \
  -k "not fp8 and (test_kernel_equals_reference or test_decode_kernel)"
for round in 1 2; do
  for probe in 0 1; do
    echo "== tune fp8 decode, scales in L2 probe=$probe round $round $(date +%T)"
    MINIVLLM_PROBE_SCALES_IN_L2=$probe timeout 90 python3 benchmarks/tune_attention.py --fp8 --cudagraph --no-sweep \
      --cases decode-256x700,decode-256xragged
  done
done
date
