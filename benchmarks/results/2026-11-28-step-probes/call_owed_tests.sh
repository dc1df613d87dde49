source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
# The checks owed since the last session: the prefill kernels' merged cache loop (f246ba8, same PTX) on the GPU,
# and test_gpu_engine.py's two long CPU-reference tests, left out of the last runs for time.
nvidia-smi --query-gpu=name --format=csv
echo "== test_triton_attention (not fp8) $(date +%T)"
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_attention.py -k "not fp8" -rf 2>&1 | tail -6
echo "== test_gpu_engine, the CPU-reference tests $(date +%T)"
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py -rf \
  -k "test_fp32_cuda_equals_cpu_reference or test_new_turns_after_a_long_cached_prefix" 2>&1 | tail -6
echo "done $(date +%T)"
