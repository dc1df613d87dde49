"""Which rounding does ops.norm_rope's Triton kernel do? Compare its output with torch emulations."""
import torch
from minivllm.worker import ops

def bf(t): return t.to(torch.bfloat16).float()

def main():
    torch.manual_seed(0)
    dev = "cuda"; rows, nq, nkv, hd = 64, 16, 8, 128
    angles = torch.rand(4096, 64, device=dev) * 6.3
    cos, sin = angles.cos(), angles.sin()
    pos = torch.randint(0, 4096, (rows,), device=dev)
    w = (1 + 0.2 * torch.randn(hd, device=dev)).to(torch.bfloat16)
    for norm in (False, True):
        q = torch.randn(rows, nq, hd, device=dev).to(torch.bfloat16); k = torch.randn(rows, nkv, hd, device=dev).to(torch.bfloat16)
        x = q.float()
        if norm:
            rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            x = bf(bf(x * rstd) * w.float())
        q2, k2 = q.clone(), k.clone()
        ops.norm_rope(q2, k2, pos, cos, sin, w if norm else None, w if norm else None, 1e-6)
        got = q2.float()
        for cs_name, cround in (("cos fp32", lambda t: t), ("cos bf16", bf)):
            c = cround(cos[pos])[:, None, :].repeat(1, 1, 2); s = cround(sin[pos])[:, None, :].repeat(1, 1, 2)
            x1, x2 = x[..., :64], x[..., 64:]
            partner = torch.cat([x2, x1], -1); sign = torch.cat([-torch.ones(64, device=dev), torch.ones(64, device=dev)])
            xc, ps = x * c, sign * partner * s
            variants = {"two products rounded": bf(bf(xc) + bf(ps)), "fma(x c, +bf(p s))": bf(xc + bf(ps)),
                        "fma(p s, +bf(x c))": bf(bf(xc) + ps), "all fp32": bf(xc + ps)}
            print(f"norm {norm} {cs_name}: " + "  ".join(f"{n} {(v == got).float().mean().item():.4f}" for n, v in variants.items()))

if __name__ == "__main__":
    main()
