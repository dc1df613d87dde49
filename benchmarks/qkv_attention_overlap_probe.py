"""Whether the decode kernel's first copies can start during the qkv projection before it.

    python3 benchmarks/qkv_attention_overlap_probe.py [--fp8] [--ragged]   # on the device machine

In a decode step the attention kernel follows the qkv projection (hopper_gemm.linear_rope, which
also stores this step's K/V). At 256 rows that GEMM runs 128 CTAs of 64 tokens, each holding ~227 KB
of shared memory (every weight stage that fits, max_stages), so no attention CTA (50 KB for the FP8
kernel) fits beside one, and the kernel's PDL start buys nothing on 128 of 132 SMs: its copies start
only as the GEMM's CTAs leave. This probe times a step's 28 layers (add + RMSNorm, linear_rope,
attention, o, add + RMSNorm, gate|up with SiLU-and-mul, down; each layer its own cache, blocks in
ascending runs as a fresh engine hands them out) with linear_rope built with fewer weight and
activation stages (room for one or two attention CTAs beside each GEMM CTA), and with wider token
tiles (fewer GEMM CTAs, whole SMs left to attention). Each variant is also timed without its
attention kernels: the difference is what attention costs inside the step. us a layer, CUDA graphs.
On the H100 none of them was faster than the engine's tiling (within ~1 us a layer, either way):
benchmarks/results/2026-11-28-qkv-overlap/call1_log.txt.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.graph_timing import graph_time_us
from benchmarks.kernel_variants import built_text
from benchmarks.tune_attention import CASES, HEAD_DIM, HEADS, KV_HEADS, build_step
from minivllm.worker import hopper_gemm, ops
from minivllm.worker.attention import triton_attention

LAYERS = 28
HIDDEN = 1024
SHAPES = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM),
          "gate_up": (6144, HIDDEN), "down": (HIDDEN, 3072)}
# The source's ROPE stage choice and activation ring, which a variant build replaces.
ROPE_STAGES = "launch<BT, max_stages<BT, true>(), false, true>"
ACTIVATION_RING = "static constexpr int SX = BT <= 32 ? 16 : BT <= 64 ? 8 : 4;"
SHARED_PER_SM = 228 * 1024
RESERVED_PER_CTA = 1024
FP8_CTA_SHARED = 4 * 3 * (2 * 16 * 128 + 2 * 16 * 2)  # fp8_decode.cu's kSharedBytes


def rope_shared_bytes(tile: int, weight_stages: int, activation_stages: int) -> int:
    """hopper_gemm.cu's Layout<tile, SW, false, true>::kBytes."""
    return (weight_stages * 8192 + activation_stages * tile * 128 + tile * 512 + 16 * tile
            + 16 * (weight_stages + activation_stages) + 1024)


def variant_library(tile: int, weight_stages: int, activation_stages: int) -> ctypes.CDLL:
    """hopper_gemm.cu built with linear_rope's CTAs of this token tile holding these many weight and
    activation stages (other tiles as the source has them)."""
    with open(hopper_gemm.SOURCE) as f:
        text = f.read()
    assert ROPE_STAGES in text and ACTIVATION_RING in text, "hopper_gemm.cu's stage choice moved: update the probe"
    stages = f"BT == {tile} ? {weight_stages} : max_stages<BT, true>()"
    text = text.replace(ROPE_STAGES, f"launch<BT, {stages}, false, true>")
    text = text.replace(ACTIVATION_RING, f"static constexpr int SX = ROPE && BT == {tile} && SW == {weight_stages} ? "
                                         f"{activation_stages} : "
                                         f"{ACTIVATION_RING.split('= ', 1)[1]}")
    return built_text(text, "hopper_gemm.cu", hopper_gemm.load_library, "qkv-overlap-probe")


class DecodeLayers:
    """A decode step's 28 layers at Qwen3-0.6B's shape over build_step's sequences, random weights:
    add + RMSNorm, linear_rope (q/k norm, RoPE, this step's K/V stored in the layer's cache), attention,
    o, add + RMSNorm, gate|up with SiLU-and-mul, down. Each layer has its own cache and weights unless
    they are shared (one of each for all 28)."""

    def __init__(self, q: torch.Tensor, cache: torch.Tensor, md, shared_weights: bool = False,
                 shared_cache: bool = False) -> None:
        dev = q.device
        self.num_tokens, self.md = q.shape[0], md
        self.caches = [cache] * LAYERS if shared_cache else [cache] + [cache.clone() for _ in range(LAYERS - 1)]
        self.layout = md.layout(cache)
        positions, slot_mapping = (md.seq_lens.long() - 1).contiguous(), md.slot_mapping.long().contiguous()
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device=dev, dtype=torch.float32) / HEAD_DIM))
        angles = torch.arange(4096, device=dev, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos_cache, sin_cache = angles.cos().contiguous(), angles.sin().contiguous()
        qk_norm = torch.ones(HEAD_DIM, device=dev, dtype=torch.bfloat16)
        gen = torch.Generator(device=dev).manual_seed(0)
        weights = [{n: torch.randn(r, c, device=dev, dtype=torch.bfloat16, generator=gen) * 0.03
                    for n, (r, c) in SHAPES.items()} for _ in range(1 if shared_weights else LAYERS)]
        self.weights = weights * LAYERS if shared_weights else weights
        self.norm_weight = torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)
        self.hidden0 = torch.randn(self.num_tokens, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty(self.num_tokens, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        self.ropes = [hopper_gemm.QkvRope(positions, slot_mapping, cos_cache, sin_cache, qk_norm, qk_norm, 1e-6, HEADS,
                                          KV_HEADS, self.caches[layer], self.layout) for layer in range(LAYERS)]

    def run(self, with_attention: bool = True, token_tile: int | None = None,
            before_qkv: Callable[[int], None] | None = None, before_mlp: Callable[[int], None] | None = None) -> None:
        """The 28 layers (without their attention kernels if not with_attention; linear_rope at
        token_tile, else its rule's), calling before_qkv(layer) and before_mlp(layer) where they say."""
        hidden, residual = self.hidden0, self.hidden0.clone()
        for layer in range(LAYERS):
            w = self.weights[layer]
            normed, residual = ops.add_rms_norm(hidden, self.norm_weight, 1e-6, residual)
            if before_qkv is not None:
                before_qkv(layer)
            qkv = hopper_gemm.linear_rope(normed, w["qkv"], self.ropes[layer], token_tile=token_tile)
            if with_attention:
                query = qkv[:, : HEADS * HEAD_DIM].view(self.num_tokens, HEADS, HEAD_DIM)
                triton_attention.decode_attention(query, self.caches[layer], self.md, HEAD_DIM**-0.5, out=self.out)
            hidden = hopper_gemm.linear(self.out.view(self.num_tokens, HEADS * HEAD_DIM), w["o"])
            normed, residual = ops.add_rms_norm(hidden, self.norm_weight, 1e-6, residual)
            if before_mlp is not None:
                before_mlp(layer)
            hidden = hopper_gemm.linear(hopper_gemm.linear(normed, w["gate_up"], silu_mul=True), w["down"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--ragged", action="store_true", help="tune_attention's decode-256xragged contexts (100-1,280)")
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--variants", default="default;64,8,8;64,12,2;64,6,4;64,8,2;96;128",
                        help="';'-separated: 'default' (the engine's), a token tile ('96': its stages as built), "
                             "or tile,weight stages,activation stages (a variant build)")
    args = parser.parse_args()
    cases = CASES["decode-256xragged"][0] if args.ragged else [(args.context, 1)] * 256
    q, cache, md, _, _ = build_step(cases, args.fp8, block_order="ascending")
    layers = DecodeLayers(q, cache, md)

    default_tile = hopper_gemm.rope_token_tile(q.shape[0], SHAPES["qkv"][0] // HEAD_DIM,
                                               torch.cuda.get_device_properties(q.device).multi_processor_count)
    shape = "100-1,280" if args.ragged else args.context
    print(f"{torch.cuda.get_device_name()} {'fp8' if args.fp8 else 'bf16'} 256 x {shape}; us a layer "
          f"(the engine's rope tile here: {default_tile})", flush=True)
    built = hopper_gemm.library()
    reference = None
    for variant in args.variants.split(";"):
        fields = [] if variant == "default" else [int(x) for x in variant.split(",")]
        tile = fields[0] if fields else default_tile
        if len(fields) == 3:
            lib = variant_library(tile, fields[1], fields[2])
            stages = fields[1], fields[2]
        else:
            lib = built
            stages = None
        hopper_gemm.library = lambda lib=lib: lib  # linear_rope and linear look it up each call
        try:
            full = graph_time_us(lambda: layers.run(True, tile)) / LAYERS
            bare = graph_time_us(lambda: layers.run(False, tile)) / LAYERS
            # The outputs of this variant's last layer against the first variant's.
            layers.run(True, tile)
            result = layers.out.float().clone()
        finally:
            hopper_gemm.library = lambda: built
        if reference is None:
            reference = result
        diff = (result - reference).abs().max().item()
        if stages is None:
            label = f"tile {tile}, stages as built"
        else:
            shared = rope_shared_bytes(tile, *stages)
            beside = (SHARED_PER_SM - RESERVED_PER_CTA - shared) // (FP8_CTA_SHARED + RESERVED_PER_CTA)
            label = f"tile {tile}, {stages[0]} weight / {stages[1]} x stages ({shared // 1024} KB; " \
                    f"{beside} FP8 CTAs fit beside)"
        print(f"  {label:<60} layer {full:7.1f}  without attention {bare:6.1f}  attention {full - bare:6.1f}  "
              f"max |out - first| {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()

