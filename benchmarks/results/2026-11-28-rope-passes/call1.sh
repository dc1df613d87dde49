# Call 1 (nvidia-h100-x1): the owed fp8_decode tests; linear_rope's epilogue taking 1-6 tokens a warp (alone, in a step, bits); the CTA timeline with the start tree's and this tree's qkv GEMM; the first wave staggered by sequence against by head.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
D=benchmarks/results/2026-11-28-rope-passes
# kernels built on the CPU box with the same nvcc (13.0): used if they load here, else built here
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
python3 -c "import ctypes,glob; [ctypes.CDLL(f) for f in glob.glob('/tmp/mvcache/kernels/**/*.so', recursive=True)]; print('prebuilt kernels load')" || rm -rf /tmp/mvcache/kernels
nvcc --version | tail -2; date +%T
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_decode.py 2>&1 | tail -4; date +%T
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_hopper_gemm.py -k rope 2>&1 | tail -3; date +%T
python3 benchmarks/rope_epilogue_probe.py --baseline $D/hopper_gemm_start.cu --passes 1,2,3,6 --rounds 2; date +%T
t() { python3 benchmarks/step_timeline_probe.py --ragged "$@" 2>&1 | grep -v "CTAs running\|globaltimer\|o projection"; }
t; t --gemm-source $D/hopper_gemm_start.cu; date +%T
MINIVLLM_FP8_DECODE_STAGGER=0 t --stagger 1000 --stagger-by seq
MINIVLLM_FP8_DECODE_STAGGER=0 t --stagger 1000 --stagger-by head; date +%T
