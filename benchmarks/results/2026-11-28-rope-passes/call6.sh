# Call 6 (nvidia-h100-x1): the bound of FP8 values stored like keys ([slot][dim]): the qkv GEMM writing each token's values as one row, the decode kernel reading rows and transposing them with byte permutes (checked bit-equal over a cache rewritten so), alone and in the step.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
python3 -c "import ctypes,glob; [ctypes.CDLL(f) for f in glob.glob('/tmp/mvcache/kernels/**/*.so', recursive=True)]; print('prebuilt kernels load')" || rm -rf /tmp/mvcache/kernels
date +%T
python3 benchmarks/rope_epilogue_probe.py --rounds 3 --caches fp8 --variants "as built,values as one row,values as one row@rows,as built@rows"; date +%T
