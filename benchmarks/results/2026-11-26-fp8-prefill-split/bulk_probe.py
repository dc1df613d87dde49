"""A/B: the FP8 decode kernel's stage fill, cp.async (default) against bulk copies, and HEAD's build; one
layer's decode of tune_attention's cases, each launch replayed in a CUDA graph, interleaved rounds.
Ran with tried_bulk_copies.diff applied to worker/attention/fp8_decode.cu (the kBulkCopies switch),
and .devtmp/s21/fp8_head.cu a copy of that file at ea896b2; as committed, neither is in the tree."""
import sys, time, os, tempfile
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import torch
from triton.testing import do_bench_cudagraph
import tune_attention as tu
from minivllm.worker.attention import fp8_decode
from minivllm.worker.attention.cuda_build import compile_library, find_nvcc

src = open("worker/attention/fp8_decode.cu").read()
variants = {"head": open(".devtmp/s21/fp8_head.cu").read(), "cp.async": src,
            "bulk": src.replace("constexpr bool kBulkCopies = false;", "constexpr bool kBulkCopies = true;")}
variants["bulk-4st"] = variants["bulk"].replace("constexpr int kStages = 3;", "constexpr int kStages = 4;").replace(
    "constexpr int kMinBlocks = 4;", "constexpr int kMinBlocks = 3;")
variants["cp.async-4st"] = src.replace("constexpr int kStages = 3;", "constexpr int kStages = 4;").replace(
    "constexpr int kMinBlocks = 4;", "constexpr int kMinBlocks = 3;")
assert variants["bulk"] != src and variants["bulk-4st"] != variants["bulk"] and variants["cp.async-4st"] != src
libs = {}
d = tempfile.mkdtemp()
for name, text in variants.items():
    path = os.path.join(d, name.replace(".", "_") + ".cu")
    open(path, "w").write(text)
    report = compile_library(find_nvcc(), path, path[:-3] + ".so")
    libs[name] = fp8_decode.load_library(path[:-3] + ".so")
    print(name, [l for l in report.splitlines() if "registers" in l][:1], flush=True)

t0 = time.time()
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
while time.time() - t0 < 3:
    x @ x
torch.cuda.synchronize()
cases = ["decode-256xragged", "decode-256x700"]
for case in cases:
    q, cache, md, k, v = tu.build_step(tu.CASES[case][0], True)
    layout = md.layout(cache)
    views = layout.split(cache)
    order = md.longest_first() if len(tu.CASES[case][0]) * tu.KV_HEADS > 132 else None
    live = sum(c + 1 for c, _ in tu.CASES[case][0])
    work = live * tu.KV_HEADS * 2 * (layout.block_bytes // (tu.BLOCK_SIZE * tu.KV_HEADS)) / 1e12
    outs, times = {}, {n: [] for n in libs}
    for rnd in range(3):
        for name, lib in libs.items():
            out = torch.empty_like(q)
            fn = lambda: fp8_decode.decode(q, views, layout, md, 128**-0.5, out, 1, order, lib=lib)
            fn(); torch.cuda.synchronize()
            times[name].append(do_bench_cudagraph(fn, rep=100, return_mode="median") * 1000)
            outs[name] = out.clone()
    print(case, flush=True)
    for name in libs:
        same = torch.equal(outs[name], outs["head"])
        diff = (outs[name].float() - outs["head"].float()).abs().max().item()
        print(f"  {name:9s} {min(times[name]):6.1f}-{max(times[name]):6.1f} us  {work / min(times[name]) * 1e6:.2f} TB/s"
              f"  {'bit-identical to head' if same else f'max|x-head| {diff:.2e}'}", flush=True)
