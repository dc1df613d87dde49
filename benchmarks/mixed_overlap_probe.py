"""A mixed step's attention: would its decodes (bandwidth-bound) and its prefill chunks (tensor-core
bound) gain from running side by side? A probe before any engine change.

    python3 benchmarks/mixed_overlap_probe.py [--decodes 58 150 230] [--fp8]   # on the device machine

In the 256-request workload's prompt phase a step holds 16,384 prompt tokens and the decodes of the
requests already running (up to ~230, contexts ~300-1,300). paged_attention runs the decode kernel
over the one-token sequences, then the prefill kernel over the rest, one after the other. Here, per
decode count (us a layer, CUDA graphs, Qwen3-0.6B's heads):
- `engine`: paged_attention as the model calls it;
- `decodes` / `prefill`: each launch alone;
- `streams`: the decode launch on a side stream beside the prefill launch (fork and join in the graph).
The outputs of `streams` and `engine` are compared bit for bit.

Found (H100, 2026-11-28; benchmarks/RESULTS.md): the side stream saves 4-8% of the pair (e.g. bf16
399.4 -> 376.3 us at 150 decodes), ~5 ms over the 256-request workload's prompt phase. Not built.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.graph_timing import graph_time_us
from benchmarks.tune_attention import HEAD_DIM, _ragged_prompts, build_step
from minivllm.worker.attention import triton_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decodes", type=int, nargs="+", default=[58, 150, 230])
    parser.add_argument("--fp8", action="store_true")
    args = parser.parse_args()
    scale = HEAD_DIM**-0.5
    real_decode = triton_attention.decode_attention
    side = torch.cuda.Stream()
    print(f"{torch.cuda.get_device_name()}{' fp8' if args.fp8 else ''}: us a layer", flush=True)
    for num_decodes in args.decodes:
        contexts = np.random.default_rng(7).integers(300, 1300, num_decodes)
        cases = _ragged_prompts(16384, 100, 1024, tuple((int(c), 1) for c in contexts) + ((600, 450),))
        q, cache, md, k, v = build_step(cases, args.fp8)
        out = torch.empty_like(q)

        def engine() -> None:
            triton_attention.paged_attention(q, cache, md, scale, out=out, key=k, value=v)

        def decodes() -> None:
            real_decode(q, cache, md, scale, out=out, mixed=True)

        def prefill() -> None:  # paged_attention with its decode launch left out
            triton_attention.decode_attention = lambda *a, out=None, **kw: out
            try:
                triton_attention.paged_attention(q, cache, md, scale, out=out, key=k, value=v)
            finally:
                triton_attention.decode_attention = real_decode

        def streams() -> None:
            main_stream = torch.cuda.current_stream()
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                decodes()
            prefill()
            main_stream.wait_stream(side)

        out.zero_()
        engine()
        expected = out.clone()
        out.zero_()
        streams()
        torch.cuda.synchronize()
        same = torch.equal(out, expected)
        times = {name: graph_time_us(fn) for name, fn in
                 (("engine", engine), ("decodes", decodes), ("prefill", prefill), ("streams", streams))}
        live = int(contexts.sum()) + num_decodes
        print(f"decodes {num_decodes:3d} (live keys {live:,}): " + "  ".join(f"{n} {t:7.1f}" for n, t in times.items())
              + f"  | sum of parts {times['decodes'] + times['prefill']:7.1f}; streams output "
              + ("bit-equal" if same else "DIFFERS"), flush=True)


if __name__ == "__main__":
    main()
