"""Decode-step projections at M rows: cuBLAS vs a Triton GEMM (optionally split-K), weights cold."""
import itertools, sys
import torch, triton, triton.language as tl
import torch.nn.functional as F


@triton.jit
def mm_kernel(a_ptr, w_ptr, c_ptr, K_PER_SPLIT, stride_am, stride_wn, stride_cs, stride_cm,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_OUT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = pid_k * K_PER_SPLIT + tl.arange(0, BK)
    a = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K_PER_SPLIT, BK):
        acc = tl.dot(tl.load(a), tl.load(w), acc)
        a += BK
        w += BK
    c = c_ptr + pid_k * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :]
    if SPLIT_OUT:
        tl.store(c, acc)
    else:
        tl.store(c, acc.to(tl.bfloat16))


@triton.jit
def sum_splits(p_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(p_ptr + s * MN + offs)
    tl.store(out_ptr + offs, acc.to(tl.bfloat16))


def triton_linear(a, w, out, partial, cfg):
    BM, BN, BK, split, stages, warps = cfg
    M, K = a.shape
    N = w.shape[0]
    grid = (M // BM, N // BN, split)
    if split == 1:
        mm_kernel[grid](a, w, out, K, a.stride(0), w.stride(0), 0, out.stride(0), BM=BM, BN=BN, BK=BK,
                        SPLIT_OUT=False, num_stages=stages, num_warps=warps)
    else:
        mm_kernel[grid](a, w, partial, K // split, a.stride(0), w.stride(0), M * N, N, BM=BM, BN=BN, BK=BK,
                        SPLIT_OUT=True, num_stages=stages, num_warps=warps)
        sum_splits[(M * N // 1024,)](partial, out, M * N, SPLIT=split, BLOCK=1024)


def time_cold(fn_for_copy, copies, reps=20):
    """Median over reps of one graph replay holding one call per weight copy, per call (us)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            fn_for_copy(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn_for_copy(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); g.replay(); e1.record(); e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1000 / copies)
    times.sort()
    return times[len(times) // 2]


SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}


def main():
    rows = [int(x) for x in (sys.argv[1:] or ["256"])]
    torch.manual_seed(0)
    for M in rows:
        total_cublas = total_best = 0.0
        for name, (K, N) in SHAPES.items():
            copies = max(8, -(-160 * 2**20 // (K * N * 2)))
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            partial = torch.empty(8 * M * N, device="cuda", dtype=torch.float32)
            ref = F.linear(a, ws[0])
            t_cublas = time_cold(lambda i: F.linear(a, ws[i], None), copies)
            results = []
            for BM, BN, BK, split, stages in itertools.product((64, 128), (32, 64, 128), (64, 128), (1, 2, 3, 4, 6, 8), (3, 4)):
                if M % BM or N % BN or K % (split * BK):
                    continue
                ctas = (M // BM) * (N // BN) * split
                if not 48 <= ctas <= 1100:
                    continue
                for warps in ((4, 8) if BM * BN >= 128 * 64 else (4,)):
                    cfg = (BM, BN, BK, split, stages, warps)
                    try:
                        triton_linear(a, ws[0], out, partial, cfg)
                        err = (out.float() - ref.float()).abs().max().item()
                        t = time_cold(lambda i: triton_linear(a, ws[i], out, partial, cfg), copies)
                    except Exception as e:  # out of shared memory etc.
                        continue
                    results.append((t, cfg, ctas, err))
            results.sort()
            gbps = K * N * 2 / t_cublas / 1e3
            print(f"M={M} {name:8s} K={K} N={N}: cuBLAS {t_cublas:6.2f} us ({gbps:.0f} GB/s of weights)")
            for t, cfg, ctas, err in results[:5]:
                print(f"    triton {t:6.2f} us  cfg(BM,BN,BK,split,stages,warps)={cfg} ctas={ctas} maxerr={err:.3g}")
            total_cublas += t_cublas
            total_best += results[0][0]
        print(f"M={M}: per layer cuBLAS {total_cublas:.1f} us, best Triton {total_best:.1f} us")


if __name__ == "__main__":
    main()
