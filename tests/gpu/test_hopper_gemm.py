"""The Hopper decode GEMM (worker/hopper_gemm.py) against an fp64 reference, every tiling it has,
and inside a CUDA graph with PDL between it and the kernels that feed it."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs a Hopper GPU (compute capability 9.0)")

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (192, 64)]


def _gemm():
    from minivllm.worker import hopper_gemm

    if hopper_gemm.library() is None:
        pytest.fail("the Hopper GEMM did not build (see the log)")
    return hopper_gemm


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [2, 7, 33, 64, 100, 128, 200, 256])
def test_every_tiling_matches_fp64(n: int, k: int, rows: int) -> None:
    hopper_gemm = _gemm()
    gen = torch.Generator(device="cuda").manual_seed(n * 1000 + k + rows)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
    ref = x.double() @ weight.double().T
    assert hopper_gemm.supports(x, weight)
    rule = hopper_gemm.tiling(rows, n, k, 132)
    tiles = {16, 48, 128, 256, rule.token_tile, -(-rows // 16) * 16}
    for tile in sorted(tiles):
        for many_stages in (False, True):
            out = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            hopper_gemm.linear(x, weight, out=out, how=hopper_gemm.Tiling(tile, many_stages))
            err = _relative_error(out, ref)
            assert err < 5e-3, (tile, many_stages, err)  # (NaN fails: every element must be written)
    # The rule's own tiling, as the layers call it.
    assert _relative_error(hopper_gemm.linear(x, weight), ref) < 5e-3


@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 1024), (1024, 3072)])
def test_every_token_tile_repeatedly(n: int, k: int) -> None:
    """Every token tile, with few and with many weight stages, three times each at 250 rows. Stages
    shared between the two consumers (an odd ring) once let a consumer pass a barrier a phase early:
    wrong sums 3-7% off, or a CTA exiting with copies in flight, in about one run in ten of this."""
    hopper_gemm = _gemm()
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(250, k, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
    ref = x.double() @ weight.double().T
    for tile in hopper_gemm.TOKEN_TILES:
        for many_stages in (False, True):
            for _ in range(3):
                out = torch.full((250, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                hopper_gemm.linear(x, weight, out=out, how=hopper_gemm.Tiling(tile, many_stages))
                err = _relative_error(out, ref)
                assert err < 5e-3, (tile, many_stages, err)


@pytest.mark.parametrize("n,k", [(6144, 1024), (192, 64), (1024, 3072)])
@pytest.mark.parametrize("rows", [2, 33, 100, 256])
def test_silu_mul_matches_fp64(n: int, k: int, rows: int) -> None:
    """A fused gate|up weight (n / 2 rows each) gives silu(x gate^T) * (x up^T), every tile width
    and both stage counts: 32 gate rows and the same 32 up rows per CTA, whatever the tile."""
    hopper_gemm = _gemm()
    gen = torch.Generator(device="cuda").manual_seed(n + k + rows)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
    gate, up = (x.double() @ weight.double().T).split(n // 2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    rule = hopper_gemm.tiling(rows, n, k, 132)
    for tile in sorted({16, 64, 144, 256, rule.token_tile}):
        for many_stages in (False, True):
            out = torch.full((rows, n // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
            hopper_gemm.linear(x, weight, out=out, how=hopper_gemm.Tiling(tile, many_stages), silu_mul=True)
            err = _relative_error(out, ref)
            assert err < 5e-3, (tile, many_stages, err)
    assert _relative_error(hopper_gemm.linear(x, weight, silu_mul=True), ref) < 5e-3


def test_strided_rows_and_untouched_neighbours() -> None:
    """x a column slice of a wider buffer, y written into a column slice of another: nothing
    outside y's slice changes."""
    hopper_gemm = _gemm()
    gen = torch.Generator(device="cuda").manual_seed(7)
    wide = torch.randn(200, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    x = wide[:, 1024:3072]
    weight = (torch.randn(1024, 2048, device="cuda", generator=gen) / 2048**0.5).to(torch.bfloat16)
    out_wide = torch.full((200, 3000), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert hopper_gemm.supports(x, weight)
    hopper_gemm.linear(x, weight, out=out_wide[:, 512:1536])
    assert _relative_error(out_wide[:, 512:1536], x.double() @ weight.double().T) < 5e-3
    assert out_wide[:, :512].isnan().all() and out_wide[:, 1536:].isnan().all()


def test_supports_only_what_it_serves() -> None:
    hopper_gemm = _gemm()
    weight = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    assert hopper_gemm.supports(x, weight)
    assert not hopper_gemm.supports(x, weight, bias=torch.zeros(4096, device="cuda", dtype=torch.bfloat16))
    assert not hopper_gemm.supports(x.half(), weight.half())
    assert not hopper_gemm.supports(torch.randn(hopper_gemm.MAX_ROWS + 1, 1024, device="cuda", dtype=torch.bfloat16),
                                    weight)
    assert not hopper_gemm.supports(x[:, :1000], weight[:, :1000])  # K not a multiple of 64
    assert not hopper_gemm.supports(x, torch.randn(4000, 1024, device="cuda", dtype=torch.bfloat16))
    big = torch.empty(hopper_gemm.MAX_WEIGHT_BYTES // 2048 + 64, 1024, device="cuda", dtype=torch.bfloat16)
    assert not hopper_gemm.supports(x, big)  # more weight than was measured against cuBLAS


@pytest.mark.parametrize("rows", [48, 256])
@pytest.mark.parametrize("fused", [True, False], ids=["silu-in-epilogue", "silu-kernel"])
def test_a_block_in_a_graph_with_pdl_equals_eager(rows: int, fused: bool) -> None:
    """An MLP block as the model runs it (add + RMSNorm, gate|up with SiLU-and-mul in its epilogue
    or after it, down, two layers), captured in a CUDA graph, where the norms (and SiLU-and-mul)
    launch with PDL ahead of the kernel, gives the bits it gives eagerly, and a float64 reference
    within bf16's rounding."""
    hopper_gemm = _gemm()
    from minivllm.worker import ops

    gen = torch.Generator(device="cuda").manual_seed(rows)
    hidden, inter = 1024, 3072
    layers = [((torch.randn(2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).to(torch.bfloat16),
               (torch.randn(hidden, inter, device="cuda", generator=gen) / inter**0.5).to(torch.bfloat16),
               (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(torch.bfloat16))
              for _ in range(2)]
    x0 = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    residual0 = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    assert hopper_gemm.starts_early(x0)

    def block(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        for gate_up, down, norm in layers:
            normed, residual = ops.add_rms_norm(x, norm, 1e-6, residual)
            activated = (hopper_gemm.linear(normed, gate_up, silu_mul=True) if fused
                         else ops.silu_and_mul(hopper_gemm.linear(normed, gate_up)))
            x = hopper_gemm.linear(activated, down)
        return x

    eager = block(x0, residual0.clone())
    residual = residual0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = block(x0, residual)
    for _ in range(3):
        residual.copy_(residual0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)

    ref, ref_residual = x0.double(), residual0.double()
    for gate_up, down, norm in layers:
        ref_residual = ref + ref_residual
        normed = ref_residual * torch.rsqrt(ref_residual.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.double()
        gate, up = (normed @ gate_up.double().T).split(inter, dim=-1)
        ref = (torch.nn.functional.silu(gate) * up) @ down.double().T
    assert _relative_error(eager, ref) < 2e-2


@pytest.mark.parametrize("rows", [1, 2, 96, 256, 300])
def test_the_decoder_layers_mlp_takes_the_fused_kernel(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """LlamaMLP.forward_normed, which the decoder layer calls, takes silu(gate) * up from the
    kernel's epilogue at the rows the kernel serves (2-256), and the separate SiLU-and-mul
    elsewhere; both agree with a float64 reference, and with $MINIVLLM_HOPPER_GEMM_SILU_MUL=0's path."""
    hopper_gemm = _gemm()
    from types import SimpleNamespace

    from minivllm.worker.models.llama import LlamaMLP, RMSNorm

    torch.manual_seed(rows)
    hidden, inter = 256, 384
    mlp = LlamaMLP(SimpleNamespace(hidden_size=hidden, intermediate_size=inter, hidden_act="silu"))
    norm = RMSNorm(hidden, 1e-6)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.randn(2 * inter, hidden) / hidden**0.5)
        mlp.down_proj.weight.copy_(torch.randn(hidden, inter) / inter**0.5)
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden))
    mlp, norm = mlp.to("cuda", torch.bfloat16), norm.to("cuda", torch.bfloat16)
    x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
    residual = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)

    fused_calls = []
    linear = hopper_gemm.linear

    def counting_linear(*args, silu_mul: bool = False, **kwargs):
        fused_calls.append(silu_mul)
        return linear(*args, silu_mul=silu_mul, **kwargs)

    monkeypatch.setattr(hopper_gemm, "linear", counting_linear)
    with torch.no_grad():
        out, summed = mlp.forward_normed(x, residual.clone(), norm)
        assert (True in fused_calls) == (2 <= rows <= 256), fused_calls
        monkeypatch.setattr(hopper_gemm, "SILU_MUL", False)
        fused_calls.clear()
        unfused, _ = mlp.forward_normed(x, residual.clone(), norm)
        assert True not in fused_calls

    ref_summed = x.double() + residual.double()
    torch.testing.assert_close(summed.double(), ref_summed, rtol=2**-8, atol=0)
    normed = ref_summed * torch.rsqrt(ref_summed.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    gate, up = (normed @ mlp.gate_up_proj.weight.double().T).split(inter, dim=-1)
    ref = (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.double().T
    assert _relative_error(out, ref) < 1e-2
    assert _relative_error(unfused, ref) < 1e-2


def _rope_case(rows: int, num_q_heads: int, num_kv_heads: int, fp8: bool, qk_norm: bool, seed: int):
    """A qkv projection's inputs and the epilogue's (positions, a cache with some padding rows)."""
    hopper_gemm = _gemm()
    from minivllm.worker.attention.kv_cache import KVCacheLayout

    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden, head_dim, max_position, block_size = 1024, 128, 4096, 16
    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(n, hidden, device="cuda", generator=gen) / hidden**0.5).to(torch.bfloat16)
    angles = torch.rand(max_position, head_dim // 2, device="cuda", generator=gen) * 6.3
    positions = torch.randint(0, max_position, (rows,), device="cuda", generator=gen)
    layout = KVCacheLayout(block_size, num_kv_heads, head_dim, torch.bfloat16, fp8=fp8)
    num_blocks = rows // 4 + 8
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=gen)[:rows]
    slots[rows // 3::5] = -1  # padding rows: stored nowhere
    norms = [(1 + 0.2 * torch.randn(head_dim, device="cuda", generator=gen)).to(torch.bfloat16) for _ in range(2)]

    def rope(cache: torch.Tensor):
        return hopper_gemm.QkvRope(positions, slots, angles.cos(), angles.sin(), *(norms if qk_norm else (None, None)),
                                   1e-6, num_q_heads, num_kv_heads, cache, layout)

    return x, weight, layout, num_blocks, rope


def _exact_qkv_rope(x, weight, r, num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The projection, q/k norm and RoPE in float64 from the same bf16 inputs (cos/sin as given)."""
    y = (x.double() @ weight.double().T).view(len(x), num_q_heads + 2 * num_kv_heads, 128)
    qk = y[:, :num_q_heads + num_kv_heads]
    if r.q_norm is not None:
        weights = torch.cat([r.q_norm.double().expand(num_q_heads, 128), r.k_norm.double().expand(num_kv_heads, 128)])
        qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + r.eps) * weights
    cos, sin = r.cos_cache.double()[r.positions][:, None], r.sin_cache.double()[r.positions][:, None]
    x1, x2 = qk[..., :64], qk[..., 64:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    return torch.cat([rotated, y[:, num_q_heads + num_kv_heads:]], 1).view(len(x), -1)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("heads,qk_norm", [((16, 8), True), ((4, 2), False), ((8, 1), True)])
@pytest.mark.parametrize("rows", [2, 37, 100, 256])
def test_linear_rope_equals_the_projection_then_norm_rope(fp8: bool, heads: tuple[int, int], qk_norm: bool,
                                                          rows: int) -> None:
    """linear_rope leaves what the plain kernel and ops.norm_rope (with its K/V store) leave: q and k
    normed and rotated in the output, v as projected, this step's K/V in their slots of the cache
    (padding rows stored nowhere, other slots untouched), at every token tile it has."""
    hopper_gemm = _gemm()
    from minivllm.worker import ops
    from minivllm.worker.attention.kv_cache import gather

    num_q_heads, num_kv_heads = heads
    x, weight, layout, num_blocks, rope = _rope_case(rows, num_q_heads, num_kv_heads, fp8, qk_norm, rows)
    ref_cache = layout.allocate(num_blocks, torch.device("cuda"))
    r = rope(ref_cache)
    ref = hopper_gemm.linear(x, weight)
    q, k, v = ref.split([num_q_heads * 128, num_kv_heads * 128, num_kv_heads * 128], dim=-1)
    ops.norm_rope(q.view(rows, num_q_heads, 128), k.view(rows, num_kv_heads, 128), r.positions, r.cos_cache,
                  r.sin_cache, r.q_norm, r.k_norm, r.eps,
                  kv_store=(v.view(rows, num_kv_heads, 128), ref_cache, r.slot_mapping, layout))
    stored = r.slot_mapping[r.slot_mapping >= 0]
    others = torch.tensor(sorted(set(range(num_blocks * 16)) - set(stored.tolist())), device="cuda")
    ref_k, ref_v = gather(layout.split(ref_cache), stored, torch.float32)
    parts = [num_q_heads * 128, num_kv_heads * 128, num_kv_heads * 128]
    exact = _exact_qkv_rope(x, weight, r, num_q_heads, num_kv_heads)
    assert hopper_gemm.supports_rope(x, weight, None, r)
    rule = hopper_gemm.rope_token_tile(rows, num_q_heads + 2 * num_kv_heads, 132)
    for tile in sorted({16, 64, 128, rule}):
        cache = layout.allocate(num_blocks, torch.device("cuda"))
        out = torch.full_like(ref, float("nan"))
        hopper_gemm.linear_rope(x, weight, rope(cache), out=out, token_tile=tile)
        # The two kernels sum K in different orders, so a sum may round to the next bf16, and they
        # round the rotation's steps differently: within a few bf16 steps, and no further from exact.
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2, msg=f"tile {tile}")
        equal = [f"{(a == b).float().mean().item():.3f}" for a, b in zip(out.split(parts, -1), ref.split(parts, -1))]
        assert float(equal[2]) > 0.97, f"tile {tile}: q, k, v equal in {equal}"
        error, ref_error = _relative_error(out, exact), _relative_error(ref, exact)
        assert error < 1.2 * ref_error, f"tile {tile}: {error} vs norm_rope's {ref_error}; q, k, v equal in {equal}"
        keys, values = gather(layout.split(cache), stored, torch.float32)
        step = 0.13 if fp8 else 2e-2  # e4m3 keeps 3 mantissa bits
        torch.testing.assert_close(keys, ref_k, rtol=step, atol=step * ref_k.abs().amax().item() / 8,
                                   msg=f"tile {tile}")
        torch.testing.assert_close(values, ref_v, rtol=step, atol=step * ref_v.abs().amax().item() / 8,
                                   msg=f"tile {tile}")
        untouched_k, untouched_v = gather(layout.split(cache), others, torch.float32)
        assert not untouched_k.any() and not untouched_v.any(), tile


def test_linear_rope_serves_only_what_it_can() -> None:
    hopper_gemm = _gemm()
    x, weight, layout, num_blocks, rope = _rope_case(64, 16, 8, True, True, 0)
    r = rope(layout.allocate(num_blocks, torch.device("cuda")))
    assert hopper_gemm.supports_rope(x, weight, None, r)
    assert not hopper_gemm.supports_rope(x, weight, None, r._replace(num_q_heads=15))  # n is not its heads
    assert not hopper_gemm.supports_rope(x, weight, None, r._replace(positions=r.positions.int()))
    assert not hopper_gemm.supports_rope(x, weight, None, r._replace(cos_cache=r.cos_cache[:, :32]))  # partial rotary
    assert not hopper_gemm.supports_rope(x[:1], weight, None, r._replace(positions=r.positions[:1],
                                                                          slot_mapping=r.slot_mapping[:1]))
