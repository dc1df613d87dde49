"""Read ceilings by block size and layout (no attention math; CUDA graphs): does a longer run per
(block, head) lift what a decode step's K/V reads can reach? 256 sequences of 704 tokens in
scattered blocks, 8 KV heads of 128, as benchmarks/read_ceilings.py.

- FP8 (kv_cache.py's layout: a head's keys one run, its values one run, then each's scales):
  blocks of 16 (2 KiB runs + 64 B of scales) against 32 (4 KiB + 128 B) and 64.
- bf16: the cache's [block, slot, head, dim] (a head's block is 16 rows of 256 B, 2 KiB apart)
  against [block, head, slot, dim] (one 4 KiB run), and blocks of 32."""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph


@triton.jit
def fp8_read(k_ptr, v_ptr, tables_ptr, out_ptr, blocks_per_seq, block_bytes, BS: tl.constexpr, SCALES: tl.constexpr,
             KV_HEADS: tl.constexpr):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    RUN: tl.constexpr = BS * 128
    offs = tl.arange(0, 2048)
    offs_s = tl.arange(0, BS)
    acc = tl.zeros([2048], dtype=tl.int32)
    sacc = tl.zeros([BS], dtype=tl.float32)
    for b in range(0, blocks_per_seq):
        blk = tl.load(tables_ptr + seq * blocks_per_seq + b).to(tl.int64)
        base = blk * block_bytes
        for c in tl.static_range(RUN // 2048):
            acc += tl.load(k_ptr + base + head * RUN + c * 2048 + offs).to(tl.int32)
            acc += tl.load(v_ptr + base + head * RUN + c * 2048 + offs).to(tl.int32)
        if SCALES:
            scales = base + KV_HEADS * RUN + head * BS * 4
            sacc += tl.load((k_ptr + scales).to(tl.pointer_type(tl.float32), bitcast=True) + offs_s)
            sacc += tl.load((v_ptr + scales).to(tl.pointer_type(tl.float32), bitcast=True) + offs_s)
    tl.store(out_ptr + (seq * KV_HEADS + head), tl.sum(acc).to(tl.float32) + tl.sum(sacc))


@triton.jit
def bf16_read(k_ptr, v_ptr, tables_ptr, out_ptr, blocks_per_seq, stride_block, stride_slot, stride_head,
              BS: tl.constexpr, BLOCK_N: tl.constexpr, KV_HEADS: tl.constexpr):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, 128)
    acc = tl.zeros([BLOCK_N, 128], dtype=tl.float32)
    for t in range(0, blocks_per_seq * BS, BLOCK_N):
        n = t + offs_n
        blk = tl.load(tables_ptr + seq * blocks_per_seq + n // BS).to(tl.int64)
        rows = blk * stride_block + (n % BS) * stride_slot + head * stride_head
        acc += tl.load(k_ptr + rows[:, None] + offs_d[None, :]).to(tl.float32)
        acc += tl.load(v_ptr + rows[:, None] + offs_d[None, :]).to(tl.float32)
    tl.store(out_ptr + (seq * KV_HEADS + head), tl.sum(acc))


def main() -> None:
    print(torch.cuda.get_device_name())
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):
        a @ a
    del a
    seqs, tokens, heads = 256, 704, 8
    res = torch.empty(seqs * heads, device="cuda", dtype=torch.float32)
    for bs in (16, 32, 64):
        bps = tokens // bs
        num_blocks = 40000 * 16 // bs
        tables = torch.randperm(num_blocks, device="cuda")[: seqs * bps].int().contiguous()
        block_bytes = bs * heads * (128 + 4)
        kc = torch.randint(0, 100, (num_blocks, block_bytes), device="cuda", dtype=torch.uint8)
        vc = torch.randint(0, 100, (num_blocks, block_bytes), device="cuda", dtype=torch.uint8)
        for scales in (True, False):
            nbytes = seqs * bps * heads * 2 * (bs * 128 + (bs * 4 if scales else 0))
            best = (0.0, None)
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    ms = do_bench_cudagraph(lambda: fp8_read[(heads, seqs)](
                        kc, vc, tables, res, bps, block_bytes, BS=bs, SCALES=scales, KV_HEADS=heads, num_warps=warps,
                        num_stages=stages))
                    best = max(best, (nbytes / ms / 1e9, (warps, stages)))
            print(f"FP8 blocks of {bs}{' with scales' if scales else ', data only'}: {best[0]:.3f} TB/s {best[1]}", flush=True)
        del kc, vc
        k = torch.randn(num_blocks, bs, heads, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        nbytes = seqs * bps * bs * heads * 128 * 2 * 2
        for layout in ("slot-major", "head-major"):
            if layout == "slot-major":
                strides = (k.stride(0), k.stride(1), k.stride(2))
            else:  # the same bytes seen as [block, head, slot, dim]
                strides = (k.stride(0), 128, bs * 128)
            best = (0.0, None)
            for bn in (32, 64):
                for warps in (4, 8):
                    ms = do_bench_cudagraph(lambda: bf16_read[(heads, seqs)](
                        k, v, tables, res, bps, *strides, BS=bs, BLOCK_N=bn, KV_HEADS=heads, num_warps=warps))
                    best = max(best, (nbytes / ms / 1e9, (bn, warps)))
            print(f"bf16 blocks of {bs}, {layout}: {best[0]:.3f} TB/s {best[1]}", flush=True)
        del k, v


if __name__ == "__main__":
    main()
