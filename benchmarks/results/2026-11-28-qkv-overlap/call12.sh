# Call 12 (nvidia-h100-x1): the final fp8_decode.cu (stagger on by default): its GPU tests, as many as the budget allows.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_fp8_decode.py -k "staggered or mixed or longest or rope or triton or refused" 2>&1 | tail -4
python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_fp8_decode.py -k "equals_reference" 2>&1 | tail -3
