import sys, torch
from minivllm.worker import hopper_gemm as hg
dev = torch.device("cuda")
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
t = int(sys.argv[1])
for name, (n, k) in SHAPES.items():
    x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    ref = x.double() @ w.double().T
    for tile in hg.TOKEN_TILES:
        for many in (False, True):
            print(name, t, tile, many, end=" ", flush=True)
            out = torch.full((t, n), float("nan"), device=dev, dtype=torch.bfloat16)
            hg.linear(x, w, out=out, how=hg.Tiling(tile, many))
            torch.cuda.synchronize()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            print(f"{err:.1e}", "OK" if err < 5e-3 else "BAD", flush=True)
