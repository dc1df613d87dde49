"""Where linear_rope's time goes: variants of the kernel that each leave one stage out (built by
make_variants.py, here or in ../2026-11-27-rope-value-lines/, into the folder given as the first
argument: every <name>.so in it), timed as rope_probe times them (28 layers in a CUDA graph, FP8
cache). --ncu: only the full kernel at 256 rows, for a profiler. --rule-only: only the tile
linear_rope's rule picks."""
import glob, os, sys, torch
from minivllm.worker import hopper_gemm, ops, pdl
from minivllm.worker.attention.kv_cache import KVCacheLayout
sys.path.insert(0, "benchmarks/results/2026-11-27-qkv-rope-epilogue")
from rope_probe import HD, HIDDEN, NKV, NQ, layer_inputs, timed

def main():
    dev = torch.device("cuda")
    hidden, nq, nkv, hd = HIDDEN, NQ, NKV, HD
    n = (nq + 2 * nkv) * hd
    weights, cos, sin, qn, kn = layer_inputs(dev)
    layout = KVCacheLayout(16, nkv, hd, torch.bfloat16, fp8=True)
    caches = [layout.allocate(4096, dev) for _ in range(4)]
    folder = next(a for a in sys.argv[1:] if not a.startswith("--"))
    libs = {os.path.basename(path)[:-3]: hopper_gemm.load_library(path)
            for path in sorted(glob.glob(os.path.join(folder, "*.so")))}
    only = "--ncu" in sys.argv
    for rows in ([256] if only else [16, 64, 128, 256]):
        x = torch.randn(rows, hidden, device=dev).to(torch.bfloat16)
        pos = torch.randint(0, 4000, (rows,), device=dev)
        slots = torch.randperm(4096 * 16, device=dev)[:rows]
        rule = hopper_gemm.rope_token_tile(rows, n // hd, pdl.num_sms(0))
        res = {"gemm": timed(lambda i: hopper_gemm.linear(x, weights[i % 8]))}
        tiles = {rule} if "--rule-only" in sys.argv else {rule, 16} if rows < 256 else {rule, 16, 32}
        for tile in sorted(tiles):
            for name, lib in libs.items():
                if only and name != "full": continue
                hopper_gemm.library = lambda lib=lib: lib
                res[f"{name}@{tile}"] = timed(lambda i: hopper_gemm.linear_rope(
                    x, weights[i % 8], hopper_gemm.QkvRope(pos, slots, cos, sin, qn, kn, 1e-6, nq, nkv, caches[i % 4], layout),
                    token_tile=tile))
        print(f"rows {rows:4d}: " + "  ".join(f"{k} {v:6.2f}" for k, v in res.items()), flush=True)

if __name__ == "__main__":
    main()
