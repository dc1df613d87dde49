#!/usr/bin/env bash
# H100: the bf16 decode kernel (Triton) at the batches nano-vllm's workload shrinks through (256 down
# to 24 sequences, contexts growing), in CUDA graphs: the default (64 keys, 4 warps, 3 stages) against
# 2 stages and a few neighbours, at the rule's splits and at 2 splits forced; the FP8 kernel too.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache
exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; date
C=decode-256xragged,decode-170xnano450,decode-120xnano620,decode-80xnano750,decode-50xnano850,decode-24xnano950
K="64,4,3,none;64,4,2,none;64,8,2,none;128,4,2,none;64,8,3,none;32,4,2,none"
for r in 1 2; do
  echo "== bf16 sweep, the rule's splits, round $r $(date +%T)"
  timeout $((r == 1 ? 210 : 130)) python3 benchmarks/tune_attention.py --cudagraph --cases $C --configs "$K" --top 6
done
echo "== bf16, 2 splits $(date +%T)"
timeout 100 python3 benchmarks/tune_attention.py --cudagraph --cases decode-120xnano620,decode-80xnano750,decode-50xnano850 \
  --configs "64,4,3,none;64,4,2,none" --decode-splits 2 --top 2
echo "== fp8 $(date +%T)"
timeout 60 python3 benchmarks/tune_attention.py --fp8 --cudagraph --no-sweep --cases $C
date
