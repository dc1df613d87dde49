# Call 3 (nvidia-h200, after the split of K was reverted: the tree is 32b0818's code): every single-GPU test file that has not yet run on an H200, in one pytest run.
source benchmarks/device_setup.sh; export MINIVLLM_CACHE=/tmp/mvcache; exec > $OUT/log.txt 2>&1
mkdir -p /tmp/mvcache && cp -r .devtmp/mvc/kernels /tmp/mvcache/
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; date +%T
timeout 520 python3 -m pytest -q -n 6 -p no:cacheprovider --durations=12 $(for f in test_cuda_graphs.py test_fp8_decode.py test_fused_sampling.py test_gpu_kv_offload.py test_gpu_output_rows.py test_gpu_sampling_outputs.py test_gpu_scheduling.py test_gpu_spec_decode.py test_graph_sampling.py test_pdl.py test_prompt_gemm.py test_small_batch_gemm.py; do echo tests/gpu/$f; done) 2>&1 | grep -v "^INFO" | tail -40; date +%T
