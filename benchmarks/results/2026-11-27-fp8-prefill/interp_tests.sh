#!/usr/bin/env bash
# CPU box: tests of test_triton_attention.py under TRITON_INTERPRET=1 (argument 1: pytest's -k
# expression; 2: the output file). The file is copied with its tensors on the CPU, bfloat16
# replaced by float16, and without the stored data's error bound (the interpreter's e4m3
# conversion fails it on every tree). Why float16: the interpreter's tl.dot reads a loaded
# bfloat16 tile's raw 16-bit patterns as integers (the attention comes out ~1e9 off), which is
# what failed the FRESH_KV comparison in ../2026-11-27-host-gaps/interp_fp8_tests.sh. With float16
# the kernels' paths run there as they do on the GPU (the decode path's SM count aside: torch.cuda).
set -e
expr=$1; out=$2
tree=$(cd "$(dirname "$0")/../../.." && pwd)
work=$(mktemp -d); mkdir -p $work/mp; ln -sfn "$tree" $work/mp/minivllm
sed -e 's/device="cuda"/device="cpu"/g; s/torch.device("cuda")/torch.device("cpu")/g; s/torch.bfloat16/torch.float16/g' \
    -e '/assert torch.all((stored - x.float()).abs() <= x.float().abs() \* 2\*\*-4/d' \
    "$tree/tests/gpu/test_triton_attention.py" > $work/test_tri_cpu.py
cd $work && TRITON_INTERPRET=1 PYTHONPATH=$work/mp python -m pytest -q -p no:cacheprovider test_tri_cpu.py -rf -k "$expr" \
  > "$out" 2>&1 || true
