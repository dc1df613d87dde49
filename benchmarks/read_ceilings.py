"""How fast the decode kernels could read their KV cache at best: the same bytes in the same access
pattern, without the attention math (GPU only).

    python benchmarks/read_ceilings.py

Times, in CUDA graphs: a 2 GiB device-to-device copy; a streaming read of 4 GiB; the bfloat16 cache's
pattern (a KV head's share of a block is 16 rows of 256 bytes at a 2 KiB stride, keys and values);
and the FP8 cache's (a head's share is one 2 KiB run of keys and one of values, plus 32 bytes of
each's bfloat16 scales: worker/attention/kv_cache.py), over 256 sequences of 704 tokens in scattered
blocks of 16, as the decode benchmarks' "decode-256x700" case (benchmarks/tune_attention.py) reads
them. A decode kernel's TB/s there over these is how close it is to what its layout allows (H100,
2026-11-26: bf16 3.04 TB/s, FP8 2.90 with float32 scales, against 2.98 and 2.80 for the kernels;
benchmarks/RESULTS.md).
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph


@triton.jit
def stream_read(x_ptr, out_ptr, n_chunks, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for c in range(pid, n_chunks, tl.num_programs(0)):
        acc += tl.load(x_ptr + c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def bf16_paged_read(k_ptr, v_ptr, tables_ptr, out_ptr, blocks_per_seq, stride_block, stride_slot,
                    BLOCK_N: tl.constexpr, KV_HEADS: tl.constexpr):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, 128)
    acc = tl.zeros([BLOCK_N, 128], dtype=tl.float32)
    for t in range(0, blocks_per_seq * 16, BLOCK_N):
        n = t + offs_n
        blk = tl.load(tables_ptr + seq * blocks_per_seq + n // 16).to(tl.int64)
        rows = blk * stride_block + (n % 16) * stride_slot + head * 128
        acc += tl.load(k_ptr + rows[:, None] + offs_d[None, :]).to(tl.float32)
        acc += tl.load(v_ptr + rows[:, None] + offs_d[None, :]).to(tl.float32)
    tl.store(out_ptr + (seq * KV_HEADS + head), tl.sum(acc))


@triton.jit
def fp8_paged_read(k_ptr, v_ptr, tables_ptr, out_ptr, blocks_per_seq, block_bytes, SCALES: tl.constexpr,
                   KV_HEADS: tl.constexpr):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    offs = tl.arange(0, 2048)
    offs_s = tl.arange(0, 16)
    acc = tl.zeros([2048], dtype=tl.int32)
    sacc = tl.zeros([16], dtype=tl.float32)
    for b in range(0, blocks_per_seq):
        blk = tl.load(tables_ptr + seq * blocks_per_seq + b).to(tl.int64)
        base = blk * block_bytes
        acc += tl.load(k_ptr + base + head * 2048 + offs).to(tl.int32)
        acc += tl.load(v_ptr + base + head * 2048 + offs).to(tl.int32)
        if SCALES:
            scales = base + KV_HEADS * 2048 + head * 32  # 16 bfloat16 scales a head (kv_cache.py)
            sacc += tl.load((k_ptr + scales).to(tl.pointer_type(tl.bfloat16), bitcast=True) + offs_s).to(tl.float32)
            sacc += tl.load((v_ptr + scales).to(tl.pointer_type(tl.bfloat16), bitcast=True) + offs_s).to(tl.float32)
    tl.store(out_ptr + (seq * KV_HEADS + head), tl.sum(acc).to(tl.float32) + tl.sum(sacc))


def main() -> None:
    print(torch.cuda.get_device_name())
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time.time()
    while time.time() - t < 3:
        a @ a
    del a
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(1 << 31, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x[: 1 << 30])
    ms = do_bench_cudagraph(lambda: y.copy_(x[: 1 << 30]))
    print(f"copy 2 GiB: {2 * y.numel() * 2 / ms / 1e9:.3f} TB/s (read + write)")
    out = torch.empty(nsm * 64, device="cuda", dtype=torch.float32)
    best = 0.0
    for chunk in (2048, 4096):
        for per_sm in (8, 16, 32):
            n_chunks = x.numel() // chunk
            ms = do_bench_cudagraph(lambda: stream_read[(nsm * per_sm,)](x, out, n_chunks, CHUNK=chunk, num_warps=8))
            best = max(best, x.numel() * 2 / ms / 1e9)
    print(f"streaming read of 4 GiB (best of 6 shapes): {best:.3f} TB/s")
    del x, y
    seqs, bps, heads, num_blocks = 256, 44, 8, 40000
    tables = torch.randperm(num_blocks, device="cuda")[: seqs * bps].int().contiguous()
    res = torch.empty(seqs * heads, device="cuda", dtype=torch.float32)
    k = torch.randn(num_blocks, 16, heads, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    nbytes = seqs * bps * 16 * heads * 128 * 2 * 2
    best = 0.0
    for bn in (32, 64):
        for warps in (4, 8):
            ms = do_bench_cudagraph(lambda: bf16_paged_read[(heads, seqs)](
                k, v, tables, res, bps, k.stride(0), k.stride(1), BLOCK_N=bn, KV_HEADS=heads, num_warps=warps))
            best = max(best, nbytes / ms / 1e9)
    print(f"bf16 paged read, 256 x 704 tokens, scattered blocks (best of 4 shapes): {best:.3f} TB/s")
    del k, v
    block_bytes = 16 * heads * (128 + 2)
    kc = torch.randint(0, 100, (num_blocks, block_bytes), device="cuda", dtype=torch.uint8)
    vc = torch.randint(0, 100, (num_blocks, block_bytes), device="cuda", dtype=torch.uint8)
    for scales in (True, False):
        nbytes = seqs * bps * heads * 2 * (2048 + (32 if scales else 0))
        best = 0.0
        for warps in (2, 4, 8):
            for stages in (2, 3, 4):
                ms = do_bench_cudagraph(lambda: fp8_paged_read[(heads, seqs)](
                    kc, vc, tables, res, bps, block_bytes, SCALES=scales, KV_HEADS=heads, num_warps=warps,
                    num_stages=stages))
                best = max(best, nbytes / ms / 1e9)
        print(f"FP8 paged read{' with scales' if scales else ', data only'} (best of 9 shapes): {best:.3f} TB/s")


if __name__ == "__main__":
    main()
