"""What an FP8 decode step's reads could cost with the scales stored otherwise (no attention math;
CUDA graphs; H100). 256 sequences of 704 tokens in scattered blocks, 8 KV heads of 128, as
benchmarks/read_ceilings.py and results/2026-11-27-block-ceilings/ceiling_blocks.py.

Each (block, head) is read as the decode kernel reads it: its keys' e4m3 run, its values' run and
each's scales. Layouts (a row per block for keys, another for values):
- "end" (kv_cache.py's now): [heads][slots][dims] e4m3, then [heads][slots] scales;
- "inline": each head's [slots][dims] e4m3 followed by its [slots] scales;
- "none": no scales (the floor).
Scales in float32 (now) or 16 bits. Printed: us a pass (all sequences, keys and values) at the
best launch shape, and TB/s of the bytes each layout holds."""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph


@triton.jit
def fp8_read(k_ptr, v_ptr, tables_ptr, out_ptr, blocks_per_seq, block_bytes, BS: tl.constexpr,
             SCALE_BYTES: tl.constexpr, INLINE: tl.constexpr, KV_HEADS: tl.constexpr):
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
        if INLINE:
            data = base + head * (RUN + BS * SCALE_BYTES)
            scales = data + RUN
        else:
            data = base + head * RUN
            scales = base + KV_HEADS * RUN + head * BS * SCALE_BYTES
        for c in tl.static_range(RUN // 2048):
            acc += tl.load(k_ptr + data + c * 2048 + offs).to(tl.int32)
            acc += tl.load(v_ptr + data + c * 2048 + offs).to(tl.int32)
        if SCALE_BYTES == 4:
            sacc += tl.load((k_ptr + scales).to(tl.pointer_type(tl.float32), bitcast=True) + offs_s)
            sacc += tl.load((v_ptr + scales).to(tl.pointer_type(tl.float32), bitcast=True) + offs_s)
        elif SCALE_BYTES == 2:
            sacc += tl.load((k_ptr + scales).to(tl.pointer_type(tl.bfloat16), bitcast=True) + offs_s).to(tl.float32)
            sacc += tl.load((v_ptr + scales).to(tl.pointer_type(tl.bfloat16), bitcast=True) + offs_s).to(tl.float32)
    tl.store(out_ptr + (seq * KV_HEADS + head), tl.sum(acc).to(tl.float32) + tl.sum(sacc))


def main() -> None:
    print(torch.cuda.get_device_name())
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):
        a @ a
    del a
    seqs, tokens, heads = 256, 704, 8
    res = torch.empty(seqs * heads, device="cuda", dtype=torch.float32)
    for bs in (16, 32):
        bps = tokens // bs
        num_blocks = 40000 * 16 // bs
        tables = torch.randperm(num_blocks, device="cuda")[: seqs * bps].int().contiguous()
        for scale_bytes, inline in ((4, False), (4, True), (2, False), (2, True), (0, False)):
            block_bytes = bs * heads * (128 + scale_bytes)
            kc = torch.randint(0, 100, (num_blocks, block_bytes), device="cuda", dtype=torch.uint8)
            vc = torch.randint(0, 100, (num_blocks, block_bytes), device="cuda", dtype=torch.uint8)
            nbytes = seqs * bps * heads * 2 * bs * (128 + scale_bytes)
            best = (float("inf"), None)
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    ms = do_bench_cudagraph(lambda: fp8_read[(heads, seqs)](
                        kc, vc, tables, res, bps, block_bytes, BS=bs, SCALE_BYTES=scale_bytes, INLINE=inline,
                        KV_HEADS=heads, num_warps=warps, num_stages=stages), rep=200)
                    best = min(best, (ms, (warps, stages)))
            where = "none" if scale_bytes == 0 else ("inline" if inline else "end")
            print(f"FP8 blocks of {bs}, scales {where} ({scale_bytes} B): {best[0] * 1e3:.1f} us, "
                  f"{nbytes / best[0] / 1e9:.3f} TB/s {best[1]}", flush=True)
            del kc, vc


if __name__ == "__main__":
    main()
