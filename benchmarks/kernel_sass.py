"""Compile the attention kernels for an H100 (sm_90) on a machine without a GPU, and print what the
compiler made of them: registers, spills, shared memory, the global loads' widths, and the mix of
SASS instructions in each loop. Costs no device time; run it before a kernel change goes to the GPU.

    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install torch==2.13.0 triton==3.6.0
    /tmp/tv/bin/pip install --no-deps -e .          # this checkout as `minivllm`, nothing else
    /tmp/tv/bin/python benchmarks/kernel_sass.py [--out DIR]

Arguments are specialized as the runtime would (pointers 16-byte aligned, integers equal to 1
constant, multiples of 16 marked so), for the Qwen3-0.6B shape (16 query heads, 8 KV heads,
head_dim 128, blocks of 16) with each cache format's strides. Without that specialization the
compiler cannot vectorize, and what it prints says nothing about the real kernel.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import minivllm.worker.attention.triton_attention as ta

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16


def compile_sm90(kernel, ints: dict, pointers: dict, constants: dict, floats: tuple, num_warps: int,
                 num_stages: int, maxnreg: int | None):
    # (constexprs left out take their defaults, as a launch that does not pass them)
    defaults = {p.name: getattr(p.default, "value", p.default)
                for p in kernel.params if p.is_constexpr and p.has_default}
    constants = {**{name: value for name, value in defaults.items() if name not in constants}, **constants}
    signature, constexprs, attrs = {}, dict(constants), {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name], attrs[(i,)] = pointers[name], [["tt.divisibility", 16]]
        elif name in floats:
            signature[name] = "fp32"
        elif ints[name] == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def report(name: str, compiled, out_dir: str | None) -> None:
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        for kind in ("ttgir", "ptx"):
            with open(os.path.join(out_dir, f"{name}.{kind}"), "w") as f:
                f.write(compiled.asm[kind])
    cubin = os.path.join(out_dir or "/tmp", f"{name}.cubin")
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    usage = subprocess.run([f"{TOOLS}/cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1)
    loads = Counter(re.findall(r"(ld\.global(?:\.v\d)?\.b\d+|cp\.async\.c[ag]\.shared\.global)", compiled.asm["ptx"]))
    print(f"{name}: {regs} registers, {stack} bytes of stack, {compiled.metadata.shared} bytes of shared memory; "
          f"loads {dict(loads)}")
    sass = subprocess.run([f"{TOOLS}/cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    instructions = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    for address, text in instructions:  # a backward branch closes a loop
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address - 0x400:
            body = [t for a, t in instructions if int(target.group(1), 16) <= a <= address]
            mix = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            print(f"  loop of {len(body)} instructions: {dict(mix.most_common(10))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write each kernel's TTGIR and PTX here")
    args = parser.parse_args()
    for fp8 in (False, True):
        cache = "*fp8e4nv" if fp8 else "*bf16"
        block_bytes = BLOCK * KV_HEADS * (HEAD_DIM + 2) if fp8 else BLOCK * KV_HEADS * HEAD_DIM  # (bf16 scales)
        strides = dict(stride_cache_block=block_bytes, stride_k_slot=KV_HEADS * HEAD_DIM, stride_k_head=HEAD_DIM)
        strides.update(dict(stride_v_slot=HEAD_DIM, stride_v_head=HEAD_DIM * BLOCK, stride_scale_block=block_bytes // 2,
                            stride_scale_slot=1, stride_scale_head=BLOCK) if fp8 else
                       dict(stride_v_slot=KV_HEADS * HEAD_DIM, stride_v_head=HEAD_DIM, stride_scale_block=0,
                            stride_scale_slot=0, stride_scale_head=0))
        ints = dict(strides, stride_q_token=(HEADS + 2 * KV_HEADS) * HEAD_DIM, stride_q_head=HEAD_DIM,
                    stride_o_token=HEADS * HEAD_DIM, stride_o_head=HEAD_DIM, stride_block_table=4096, num_seqs=257,
                    num_kv_heads=KV_HEADS, stride_key_token=KV_HEADS * HEAD_DIM, stride_key_head=HEAD_DIM,
                    stride_value_token=(HEADS + 2 * KV_HEADS) * HEAD_DIM, stride_value_head=HEAD_DIM, num_heads=HEADS)
        pointers = {name: cache if name in ("k_cache_ptr", "v_cache_ptr") else "*bf16" if "scale_ptr" in name
                    else "*fp32" if "scale" in name or "partial" in name
                    else "*i32" if name in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "seq_order_ptr",
                                            "positions_ptr", "num_active_seqs_ptr", "arrivals_ptr")
                    else "*i64" if name == "slot_mapping_ptr"
                    else "*fp32" if name in ("cos_ptr", "sin_ptr")
                    else "*bf16" for name in ta._paged_decode_kernel.arg_names + ta._paged_attention_kernel.arg_names
                    if name.endswith("_ptr")}
        # a large batch's kernel (one split, longest first), and batch 1's (RoPE inside, 8 splits;
        # a plain cache's few-sequence shape where the tree has one)
        for name, splits, rope in (("", 1, False), ("-batch1", 8, True)):
            decode = ta.DECODE_FP8 if fp8 else getattr(ta, "DECODE_FEW", ta.DECODE) if rope else ta.DECODE
            compiled = compile_sm90(ta._paged_decode_kernel, ints, pointers, dict(
                HEADS_PER_KV=HEADS // KV_HEADS, GROUP_PADDED=16, HEAD_DIM=HEAD_DIM, HEAD_DIM_PADDED=HEAD_DIM,
                BLOCK_SIZE=BLOCK, BLOCK_N=decode.block_n, NUM_SPLITS=splits, IEEE_FP32=False, FP8=fp8, MIXED=False,
                ORDERED=splits == 1, PDL=rope, ROPE=rope, HAS_NORM=rope, HALF_ROT=HEAD_DIM // 2, FP8_MAX=ta.FP8_MAX,
                MIN_SCALE=ta.MIN_SCALE), ("scale_log2e", "eps"), decode.num_warps,
                decode.num_stages, decode.maxnreg)
            report(f"decode-{'fp8' if fp8 else 'bf16'}{name}", compiled, args.out)
        # a long prompt's step (a chunk's own keys from the cache, or from the step's k and v), and a
        # short chunk after a long prefix (a few-sequence step: contexts split, decodes included)
        for fresh_kv, splits in ((False, 1), (True, 1), (fp8, ta.PREFILL_SPLITS)):
            prefill = ta.PREFILL_SHORT if splits > 1 else ta.PREFILL_FP8 if fp8 else ta.PREFILL
            compiled = compile_sm90(ta._paged_attention_kernel, ints, pointers, dict(
                prefill_shape(prefill, fp8, fresh_kv), SPLIT_DECODES=splits == 1, NUM_SPLITS=splits,
                WHICH_SEQS=ta.ALL_SEQS.value), ("scale_log2e",), prefill.num_warps, prefill.num_stages, prefill.maxnreg)
            report(f"prefill-{'fp8' if fp8 else 'bf16'}{'-fresh' if fresh_kv else ''}{'-split' if splits > 1 else ''}",
                   compiled, args.out)
        if not fp8:
            continue
        # A large FP8 step's two launches (paged_attention): its fresh prompts on the plain kernel
        # (this step's k and v stand in for the cache), its chunks after a cached context on the FP8
        # one (_cached_prefill_kernel, where the tree has it).
        plain = dict(pointers, k_cache_ptr="*bf16", v_cache_ptr="*bf16", k_scale_ptr="*bf16", v_scale_ptr="*bf16")
        fresh = ta.PREFILL_FP8_FRESH
        compiled = compile_sm90(ta._paged_attention_kernel, ints, plain, dict(
            prefill_shape(fresh, False, True), SPLIT_DECODES=True, NUM_SPLITS=1, WHICH_SEQS=ta.FRESH_SEQS.value,
            **joined(ta._paged_attention_kernel, "JOINS_PREVIOUS")),
            ("scale_log2e",), fresh.num_warps, fresh.num_stages, fresh.maxnreg)
        report("prefill-fp8-step-fresh-seqs", compiled, args.out)
        cached = ta.PREFILL_FP8
        if hasattr(ta, "_cached_prefill_kernel"):
            kernel, which = ta._cached_prefill_kernel, dict(MAX_SEQS=512)
        else:
            kernel, which = ta._paged_attention_kernel, dict(NUM_SPLITS=1, WHICH_SEQS=ta.CACHED_SEQS.value)
        constants = dict(prefill_shape(cached, True, True), SPLIT_DECODES=True, **which, **joined(kernel, "PDL"))
        compiled = compile_sm90(kernel, ints, pointers, constants, ("scale_log2e",), cached.num_warps,
                                cached.num_stages, cached.maxnreg)
        report("prefill-fp8-step-cached-seqs", compiled, args.out)


def joined(kernel, flag: str) -> dict:
    """The two launches run side by side under PDL where the tree has the flag (paged_attention's `joins`)."""
    return {flag: True} if flag in kernel.arg_names else {}


def prefill_shape(prefill, fp8: bool, fresh_kv: bool) -> dict:
    """The prefill kernels' tile constants for a PrefillConfig at this shape."""
    return dict(HEADS_PER_KV=HEADS // KV_HEADS, HEAD_DIM=HEAD_DIM, HEAD_DIM_PADDED=HEAD_DIM, BLOCK_SIZE=BLOCK,
                BLOCK_Q=prefill.block_m // (HEADS // KV_HEADS), BLOCK_M=prefill.block_m, BLOCK_N=prefill.block_n,
                IEEE_FP32=False, FP8=fp8, FRESH_KV=fresh_kv, ACTIVE_SEQS=True)


if __name__ == "__main__":
    main()
