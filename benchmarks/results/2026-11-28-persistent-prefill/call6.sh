# Call 6 (nvidia-h200): multicast_copy_probe.py at 256 and 128 rows: each decode projection's copies by TMA in the Hopper GEMM's tiling, the same with activation or weight boxes multicast in clusters of 2 and 4, the launches alone, and the GEMM itself.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; date +%T
timeout 200 python3 benchmarks/multicast_copy_probe.py --rows 256; date +%T
timeout 150 python3 benchmarks/multicast_copy_probe.py --rows 128; date +%T
