"""Does cuBLAS's nvjet GEMM wait on griddepcontrol, so that a programmatic (PDL) edge into it in a
CUDA graph would be safe? (H100 probe; the answer, pdl_into_cublas.txt: no.)"""
import os
import sys
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cugraph_edges as ce


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def slow_add_one(x_ptr, n, wait_ns, BLOCK: tl.constexpr):
    gdc_launch_dependents()  # let the next kernel start now
    start = _now()
    while _now() - start < wait_ns:
        pass
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1.0, mask=m)


@triton.jit
def copy_nowait(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m), mask=m)


def correctness(m, n, k, consumer):
    x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 32
    grid = (triton.cdiv(m * k, 1024),)

    def body():
        slow_add_one[grid](x, m * k, 200_000, BLOCK=1024)
        if consumer == "gemm":
            return F.linear(x, w)
        y = torch.empty_like(x)
        copy_nowait[grid](x, y, m * k, BLOCK=1024)
        return y
    body(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        out = body()
    changed, names = ce.make_programmatic(g.raw_cuda_graph(), into=lambda s: s.startswith("nvjet") or "copy_nowait" in s)
    g.instantiate()
    bad = 0
    for it in range(5):
        x.zero_(); torch.cuda.synchronize()
        g.replay(); torch.cuda.synchronize()
        ref = F.linear(torch.ones_like(x), w) if consumer == "gemm" else torch.ones_like(x)
        err = (out.float() - ref.float()).abs().max().item()
        bad += err > 1e-2
    kernels = sorted({v for v in names.values() if v})
    print(f"{consumer} m={m} n={n} k={k}: edges made programmatic {changed}; wrong in {bad}/5 replays; kernels {kernels}")


if __name__ == "__main__":
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    for shape in [(256, 4096, 1024), (256, 1024, 2048), (256, 6144, 1024), (256, 1024, 3072), (128, 4096, 1024),
                  (16384, 4096, 1024), (16384, 1024, 3072)]:
        correctness(*shape, consumer="gemm")
    correctness(256, 1024, 1024, consumer="copy")
