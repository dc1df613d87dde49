# Call 1 (nvidia-h100-x1): qkv_attention_overlap_probe.py, FP8 twice and bf16 once.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 benchmarks/qkv_attention_overlap_probe.py --fp8 --ragged
python3 benchmarks/qkv_attention_overlap_probe.py --fp8 --ragged
python3 benchmarks/qkv_attention_overlap_probe.py --fp8 --context 700
python3 benchmarks/qkv_attention_overlap_probe.py --ragged --variants "default;64,8,8;64,6,4;128"
