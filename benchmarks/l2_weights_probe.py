"""Would a decode step's projections run faster if the attention kernel before them pulled their
weights into L2? A probe on Qwen3-0.6B's shapes, before any engine change.

    python3 benchmarks/l2_weights_probe.py [--rows 256 128] [--stream-mb 256]   # on the device machine

A decode step's layer is: add + RMSNorm, qkv, attention (a bandwidth-bound read of hundreds of MB of
K/V, 140-260 us), o, add + RMSNorm, gate|up with SiLU-and-mul, down. The four projections read ~30 MB
of weights, ~10 us at 3 TB/s, yet take ~35 us at 256 rows (RESULTS.md, eighteenth session), each
starting cold. Here the attention is stood in for by a kernel that reads `--stream-mb` of a large
buffer. Variants (us a layer over 28 layers in one CUDA graph, each layer with its own weights
unless said):

- `warm`: no stand-in, every layer the same weights (L2 serves them: the bound on what a prefetch
  could give);
- `cold`: no stand-in, 28 layers' weights;
- `stream`: the stand-in between qkv and o, nothing prefetched;
- `pf-normal@start|end`: the stand-in's programs issue `prefetch.global.L2` for this layer's o,
  gate|up and down and the next layer's qkv (30 MB) before, or after, their share of the read;
- `pf-last@start|end`: the same with `prefetch.global.L2::evict_last`, and the previous layer's lines
  handed back to normal priority (`applypriority.global.L2::evict_normal`) so that they do not pile up.

`stream-alone` and `pf-last-alone` time the stand-in by itself, to see what the prefetch costs it.
Each layer's weights lie in one buffer here (qkv, o, gate|up, down back to back); the prefetch
covers the span after qkv up to the next layer's qkv.

Found (H100, 2026-11-28; benchmarks/RESULTS.md): warm 34.91 against cold 35.03 us a layer at 256
rows, so the projections there do not wait on DRAM; every prefetch variant was slower.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for benchmarks.graph_timing

from benchmarks.graph_timing import graph_time_us
from minivllm.worker import hopper_gemm, ops

HIDDEN = 1024
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
LAYERS = 28
LINE_ELEMENTS = 64  # bf16 elements in a 128-byte line

PREFETCH_ASM = {
    "normal": "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
    "last": "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
}
DEMOTE_ASM = "applypriority.global.L2::evict_normal [$1], 128;\n\tmov.u32 $0, 0;"


@triton.jit
def _touch_lines(base_ptr, num_lines, ASM: tl.constexpr, LINES: tl.constexpr):
    """Runs ASM (a prefetch or a priority change) on this program's share of num_lines lines."""
    pid = tl.program_id(0)
    share = tl.cdiv(num_lines, tl.num_programs(0))
    for start in range(pid * share, tl.minimum((pid + 1) * share, num_lines), LINES):
        lines = start + tl.arange(0, LINES)
        lines = tl.minimum(lines, num_lines - 1)
        tl.inline_asm_elementwise(ASM, "=r,l", [base_ptr + lines.to(tl.int64) * 64], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _prefetch_and_demote(fetch1_ptr, fetch1_lines, fetch2_ptr, fetch2_lines, demote1_ptr, demote1_lines,
                         demote2_ptr, demote2_lines, FETCH_ASM: tl.constexpr, DEMOTE_ASM: tl.constexpr,
                         LINES: tl.constexpr):
    _touch_lines(fetch1_ptr, fetch1_lines, FETCH_ASM, LINES)
    _touch_lines(fetch2_ptr, fetch2_lines, FETCH_ASM, LINES)
    _touch_lines(demote1_ptr, demote1_lines, DEMOTE_ASM, LINES)
    _touch_lines(demote2_ptr, demote2_lines, DEMOTE_ASM, LINES)


@triton.jit
def _stream_kernel(src_ptr, out_ptr, chunk_elements, fetch1_ptr, fetch1_lines, fetch2_ptr, fetch2_lines,
                   demote1_ptr, demote1_lines, demote2_ptr, demote2_lines,
                   FETCH_ASM: tl.constexpr, DEMOTE_ASM: tl.constexpr, WHERE: tl.constexpr,
                   BLOCK: tl.constexpr, LINES: tl.constexpr):
    """Each program sums its chunk of src (the attention stand-in); WHERE 0: no prefetch, 1: prefetch
    (and demote) before the read, 2: after it."""
    pid = tl.program_id(0)
    if WHERE == 1:
        _prefetch_and_demote(fetch1_ptr, fetch1_lines, fetch2_ptr, fetch2_lines, demote1_ptr, demote1_lines,
                             demote2_ptr, demote2_lines, FETCH_ASM, DEMOTE_ASM, LINES)
    base = src_ptr + pid.to(tl.int64) * chunk_elements
    acc = tl.zeros([BLOCK], tl.float32)
    for offset in range(0, chunk_elements, BLOCK):
        acc += tl.load(base + offset + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))
    if WHERE == 2:
        _prefetch_and_demote(fetch1_ptr, fetch1_lines, fetch2_ptr, fetch2_lines, demote1_ptr, demote1_lines,
                             demote2_ptr, demote2_lines, FETCH_ASM, DEMOTE_ASM, LINES)


def make_layer(dev: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    sizes = [n * k for n, k in SHAPES.values()]
    buffer = torch.randn(sum(sizes), device=dev, dtype=torch.bfloat16) * 0.03
    views, offset = {}, 0
    for (name, (n, k)), size in zip(SHAPES.items(), sizes):
        views[name] = buffer[offset:offset + size].view(n, k)
        offset += size
    return buffer, views


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 128])
    parser.add_argument("--stream-mb", type=int, default=256, help="MB the attention stand-in reads a layer")
    args = parser.parse_args()
    dev = torch.device("cuda")
    layers = [make_layer(dev) for _ in range(LAYERS)]
    norm_weight = torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)
    num_programs = torch.cuda.get_device_properties(dev).multi_processor_count * 4
    block = 4096
    chunk = -(-args.stream_mb * 2**20 // 2 // num_programs // block) * block
    slices = 8
    source = torch.ones(slices * num_programs * chunk, device=dev, dtype=torch.bfloat16)
    sums = torch.empty(num_programs, device=dev, dtype=torch.float32)
    qkv_elements = SHAPES["qkv"][0] * SHAPES["qkv"][1]

    def lines(t: torch.Tensor) -> int:
        return t.numel() // LINE_ELEMENTS

    def stand_in(layer: int, mode: str, where: int) -> None:
        # Fetched: this layer's o, gate|up, down and the next layer's qkv. Demoted (evict_last only):
        # what the stand-in before fetched, all of it read by now.
        if mode == "none":
            where = 0
        this = layers[layer][0]
        fetch1, fetch2 = this[qkv_elements:], layers[(layer + 1) % LAYERS][0][:qkv_elements]
        demote1, demote2 = layers[layer - 1][0][qkv_elements:], this[:qkv_elements]
        demote_lines = lines(demote1) if mode == "last" and layer > 0 else 0
        _stream_kernel[(num_programs,)](source[(layer % slices) * num_programs * chunk:], sums, chunk,
                                        fetch1, lines(fetch1), fetch2, lines(fetch2),
                                        demote1, demote_lines, demote2, lines(demote2) if demote_lines else 0,
                                        FETCH_ASM=PREFETCH_ASM["last" if mode == "last" else "normal"],
                                        DEMOTE_ASM=DEMOTE_ASM, WHERE=where, BLOCK=block, LINES=256, num_warps=8)

    print(f"{torch.cuda.get_device_name()}: us a layer (28 layers in one graph); stand-in reads "
          f"{num_programs * chunk * 2 / 2**20:.0f} MB a layer", flush=True)
    for rows in args.rows:
        hidden0 = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16)
        residual0 = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16)

        def chain(same_weights: bool = False, mode: str | None = None, where: int = 0) -> torch.Tensor:
            hidden, residual = hidden0, residual0.clone()
            for layer in range(LAYERS):
                weights = layers[0 if same_weights else layer][1]
                normed, residual = ops.add_rms_norm(hidden, norm_weight, 1e-6, residual)
                qkv = hopper_gemm.linear(normed, weights["qkv"])
                if mode is not None:
                    stand_in(layer, mode, where)
                hidden = hopper_gemm.linear(qkv[:, :2048], weights["o"])
                normed, residual = ops.add_rms_norm(hidden, norm_weight, 1e-6, residual)
                activated = hopper_gemm.linear(normed, weights["gate_up"], silu_mul=True)
                hidden = hopper_gemm.linear(activated, weights["down"])
            return hidden

        reference = chain()
        for mode in ("normal", "last"):
            for where in (1, 2):
                torch.testing.assert_close(chain(mode=mode, where=where), reference, rtol=0, atol=0)
        results = {
            "warm": graph_time_us(lambda: chain(same_weights=True)) / LAYERS,
            "cold": graph_time_us(chain) / LAYERS,
            "stream": graph_time_us(lambda: chain(mode="none")) / LAYERS,
        }
        for mode in ("normal", "last"):
            for where, name in ((1, "start"), (2, "end")):
                results[f"pf-{mode}@{name}"] = graph_time_us(lambda: chain(mode=mode, where=where)) / LAYERS
        results["stream-alone"] = graph_time_us(lambda: [stand_in(i, "none", 0) for i in range(LAYERS)]) / LAYERS
        results["pf-last-alone"] = graph_time_us(lambda: [stand_in(i, "last", 2) for i in range(LAYERS)]) / LAYERS
        print(f"rows {rows:3d}  " + "  ".join(f"{k} {v:6.2f}" for k, v in results.items()), flush=True)


if __name__ == "__main__":
    main()
