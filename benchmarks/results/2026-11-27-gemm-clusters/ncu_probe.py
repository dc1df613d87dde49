"""ncu probe: the Hopper GEMM's four decode projections (and cuBLAS) at 2, 64 and 256 rows, one launch each
after a warm-up pass. Run under ncu with --launch-skip = the warm-up's launch count."""
import sys
import torch
from minivllm.worker import hopper_gemm as hg

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
dev = "cuda"
ws = {nm: torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for nm, (n, k) in SHAPES.items()}
xs = {(t, k): torch.randn(t, k, device=dev, dtype=torch.bfloat16) for t in (2, 64, 256) for k in (1024, 2048, 3072)}
assert hg.library() is not None
nsm = torch.cuda.get_device_properties(0).multi_processor_count

def one_pass(tag):
    for t in (2, 64, 256):
        for nm, (n, k) in SHAPES.items():
            x = xs[(t, k)]
            hg.linear(x, ws[nm])
            torch.mm(x, ws[nm].T)
            if tag:
                print(f"{tag} T={t} {nm} rule={hg.tiling(t, n, k, nsm)}", file=sys.stderr)
        hg.linear(xs[(t, 1024)], ws["gate_up"], silu_mul=True)
    torch.cuda.synchronize()

one_pass("")
one_pass("measured")
