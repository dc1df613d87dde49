"""us a layer for each kernel make_variants.py built (the folder given as the argument), at the tile
linear_rope's rule picks, timed as rope_probe times them (28 layers in a CUDA graph with PDL, FP8
cache). Run from the repository root at a tree with linear_rope (main from 210be35)."""
import glob, os, sys, torch
from minivllm.worker import hopper_gemm, pdl
from minivllm.worker.attention.kv_cache import KVCacheLayout
sys.path.insert(0, "benchmarks/results/2026-11-27-qkv-rope-epilogue")
from rope_probe import HD, HIDDEN, NKV, NQ, layer_inputs, timed


def main():
    dev = torch.device("cuda")
    n = (NQ + 2 * NKV) * HD
    weights, cos, sin, qn, kn = layer_inputs(dev)
    layout = KVCacheLayout(16, NKV, HD, torch.bfloat16, fp8=True)
    caches = [layout.allocate(4096, dev) for _ in range(4)]
    libs = {os.path.basename(path)[:-3]: hopper_gemm.load_library(path)
            for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.so")))}
    for rows in (16, 64, 128, 256):
        x = torch.randn(rows, HIDDEN, device=dev).to(torch.bfloat16)
        pos = torch.randint(0, 4000, (rows,), device=dev)
        slots = torch.randperm(4096 * 16, device=dev)[:rows]
        tile = hopper_gemm.rope_token_tile(rows, n // HD, pdl.num_sms(0))
        res = {"gemm": timed(lambda i: hopper_gemm.linear(x, weights[i % 8]))}
        for name, lib in libs.items():
            hopper_gemm.library = lambda lib=lib: lib
            res[f"{name}@{tile}"] = timed(lambda i: hopper_gemm.linear_rope(
                x, weights[i % 8], hopper_gemm.QkvRope(pos, slots, cos, sin, qn, kn, 1e-6, NQ, NKV, caches[i % 4], layout),
                token_tile=tile))
        print(f"rows {rows:4d}: " + "  ".join(f"{k} {v:6.2f}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
