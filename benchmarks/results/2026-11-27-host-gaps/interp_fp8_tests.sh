#!/usr/bin/env bash
# CPU box: test_triton_attention.py's FP8 cache tests under TRITON_INTERPRET=1, on a tree (argument:
# the checkout, linked as `minivllm`). The test file is copied with its tensors moved to the CPU and
# without the stored data's error bound (the interpreter's e4m3 conversion fails it on the start
# tree too). What passes there: the stored scales equal quantize's, and each kernel reading the FP8
# cache matches the reference reading it (error < 1e-2). What the interpreter cannot run: the decode
# path's SM count (torch.cuda), and the FRESH_KV comparison (both trees: relative error ~1e9).
set -e
tree=$1; out=$2
work=$(mktemp -d); mkdir -p $work/mp; ln -sfn "$tree" $work/mp/minivllm
sed -e 's/device="cuda"/device="cpu"/g; s/torch.device("cuda")/torch.device("cpu")/g' \
    -e '/assert torch.all((stored - x.float()).abs() <= x.float().abs() \* 2\*\*-4/d' \
    "$tree/tests/gpu/test_triton_attention.py" > $work/test_tri_cpu.py
cd $work && TRITON_INTERPRET=1 PYTHONPATH=$work/mp python -m pytest -q -p no:cacheprovider test_tri_cpu.py \
  -k "(test_fp8_cache and (mixed-16-1-128 or mixed-7-4-96 or large-16-4-128 or decode-32-1-64)) or (takes_decodes_too and fp8) or (context_splits and fp8)" \
  2>&1 | grep -E "^E  +AssertionError|^test_tri_cpu.py:[0-9]+: |^FAILED|passed|failed" > "$out" || true
