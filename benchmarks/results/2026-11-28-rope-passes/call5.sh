# Call 5 (nvidia-h100-x1): the bound of an FP8 decode step whose qkv GEMM writes each token's values as one row and no scales, and whose decode kernel writes its sequence's last block back whole.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
python3 -c "import ctypes,glob; [ctypes.CDLL(f) for f in glob.glob('/tmp/mvcache/kernels/**/*.so', recursive=True)]; print('prebuilt kernels load')" || rm -rf /tmp/mvcache/kernels
date +%T
python3 benchmarks/rope_epilogue_probe.py --rounds 3 --caches fp8 --variants "as built,values as one row+no scales,values as one row+no scales@write back,as built@write back,no value bytes+no scales"; date +%T
