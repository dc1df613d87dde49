source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
# As run: with tried_next_layer_prefetch.diff applied (the --prefetch option and the kernel side were reverted after this call).
nvidia-smi --query-gpu=name --format=csv
P=benchmarks/decode_in_context_probe.py
for r in 1 2; do
  timeout 120 python3 $P --fp8 --ragged
  for b in 4 8 16; do
    MINIVLLM_FP8_NEXT_LAYER_BLOCKS=$b timeout 60 python3 $P --fp8 --ragged --prefetch
    MINIVLLM_FP8_NEXT_LAYER_BLOCKS=$b MINIVLLM_FP8_NEXT_LAYER_EVICT_LAST=1 timeout 60 python3 $P --fp8 --ragged --prefetch
  done
done
timeout 60 python3 $P --fp8
MINIVLLM_FP8_NEXT_LAYER_BLOCKS=8 timeout 60 python3 $P --fp8 --prefetch
echo done
