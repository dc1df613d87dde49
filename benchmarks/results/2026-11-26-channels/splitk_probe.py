"""Probe: a Triton split-K GEMM against cuBLAS for Qwen3-0.6B's projections at 16-256 rows, in CUDA graphs.

Each timing: a graph of 28 calls rotating over 8 weights (not L2-resident), per call in us.
Variants: plain (acc[M,N] = x W^T) or swapped (acc[N,M] = W x^T), split S over K writing fp32 partials
(S=1 writes bf16), then (S>1) a reduce kernel. 'gemm only' = partial GEMM without its reduce (what a
consumer that sums the partials itself would see).
"""
import itertools, sys, time
import torch, triton, triton.language as tl
import torch.nn.functional as F

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


@triton.jit
def splitk_kernel(x_ptr, w_ptr, out_ptr, M, N, K_SPLIT, stride_xm, stride_wn, stride_os, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                  OUT_BF16: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_s * K_SPLIT + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    m_mask = offs_m[:, None] < M
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        a = tl.load(x_ptrs, mask=m_mask, other=0.0)
        b = tl.load(w_ptrs)
        if SWAP:
            acc = tl.dot(b, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP:
        out = tl.trans(acc)
    else:
        out = acc
    o_ptrs = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    if OUT_BF16:
        tl.store(o_ptrs, out.to(tl.bfloat16), mask=m_mask)
    else:
        tl.store(o_ptrs, out, mask=m_mask)


@triton.jit
def reduce_kernel(part_ptr, out_ptr, MN, S: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(tl.bfloat16), mask=mask)


def make_call(x, out_bf16, part, cfg, split, with_reduce=True):
    bm, bn, bk, swap, warps, stages = cfg
    m, k = x.shape
    n = out_bf16.shape[1]
    grid = (n // bn, triton.cdiv(m, bm), split)
    k_split = k // split

    def call(w):
        if split == 1:
            splitk_kernel[grid](x, w, out_bf16, m, n, k_split, x.stride(0), w.stride(0), 0, out_bf16.stride(0),
                                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWAP=swap, OUT_BF16=True,
                                num_warps=warps, num_stages=stages)
        else:
            splitk_kernel[grid](x, w, part, m, n, k_split, x.stride(0), w.stride(0), part.stride(0), part.stride(1),
                                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWAP=swap, OUT_BF16=False,
                                num_warps=warps, num_stages=stages)
            if with_reduce:
                reduce_kernel[(triton.cdiv(m * n, 1024),)](part, out_bf16, m * n, S=split, BLOCK=1024)
    return call


def graph_us(fn, weights, calls=28, reps=30):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for w in weights:
            fn(w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(weights[i % len(weights)])
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2] * 1e3 / calls


def configs(m):
    out = []
    for swap in (False, True):
        for bm in (16, 32, 64, 128, 256):
            if bm > max(16, triton.next_power_of_2(m)):
                continue
            if not swap and bm < 64:
                continue
            for bn in (64, 128):
                if swap and bn < 64:
                    continue
                for bk in (64, 128):
                    if bm * bn >= 128 * 256 and bk > 64:
                        continue
                    warps = 8 if bm * bn >= 128 * 128 else 4
                    for stages in (3, 4):
                        out.append((bm, bn, bk, swap, warps, stages))
    return out


def main():
    torch.manual_seed(0)
    rows = [int(a) for a in sys.argv[1:]] or [16, 64, 128, 256]
    dev = torch.cuda.get_device_name()
    print(f"# {dev}; torch {torch.__version__}; triton {triton.__version__}")
    for m in rows:
        total_cublas, total_best, total_best_gemm_only = 0.0, 0.0, 0.0
        for name, (n, k) in SHAPES.items():
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(8)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            part = torch.empty(8, m, n, device="cuda", dtype=torch.float32)
            ref = F.linear(x.float(), weights[0].float())
            cub = graph_us(lambda w: torch.mm(x, w.t(), out=out), weights)
            results = []
            for cfg in configs(m):
                for split in (1, 2, 4, 8):
                    if (k // split) % cfg[2]:
                        continue
                    try:
                        call = make_call(x, out, part, cfg, split)
                        out.zero_()
                        call(weights[0])
                        torch.cuda.synchronize()
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        if not err < 1e-2:
                            print("BAD", name, m, cfg, split, err)
                            continue
                        t = graph_us(call, weights)
                        t_only = graph_us(make_call(x, out, part, cfg, split, with_reduce=False), weights) if split > 1 else t
                        results.append((t, t_only, cfg, split))
                    except Exception as e:  # out of resources etc.
                        print("skip", cfg, split, type(e).__name__, str(e)[:80])
            results.sort(key=lambda r: r[0])
            best = results[0]
            best_only = min(results, key=lambda r: r[1])
            total_cublas += cub; total_best += best[0]; total_best_gemm_only += best_only[1]
            print(f"M={m:4d} {name:8s} cuBLAS {cub:6.2f} us | best {best[0]:6.2f} {best[2]} S={best[3]} "
                  f"| gemm-only best {best_only[1]:6.2f} {best_only[2]} S={best_only[3]}")
            for r in results[:5]:
                print(f"      {r[0]:6.2f} (gemm only {r[1]:6.2f}) {r[2]} S={r[3]}")
            sys.stdout.flush()
        print(f"M={m:4d} per layer: cuBLAS {total_cublas:6.2f} us, best split-K {total_best:6.2f}, "
              f"best without reduce {total_best_gemm_only:6.2f}")


if __name__ == "__main__":
    main()
