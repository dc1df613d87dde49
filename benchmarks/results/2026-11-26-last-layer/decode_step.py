"""Where a 256-sequence decode step of the 256-request workload goes, against what its bytes allow
(H100, session_start.txt: 20 decode-only steps from the 101st, contexts ~560-1,380). Writes
decode_step.png beside this file.

Floors: attention at the read ceiling of its cache layout (read_ceilings.py: 3.04 TB/s for bf16's,
2.90 for FP8's, here applied to the bytes the measured kernel read at its measured rate); every
weight read once at 3.0 TB/s (the projections 0.88 GB, the LM head 0.31 GB: at 256 rows their
FLOPs at ~780 TFLOP/s take about as long); norms, SiLU-and-mul and the sampler at 3.0 TB/s of
their activations; no time between kernels. (FP8's time between kernels is taken as bf16's: its
profiled window had one long gap while the host was elsewhere.)
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# ms per step: (measured, floor). Both runs measured the same kernels around attention.
PROJECTIONS = {"projections": (0.84, 0.29)}
REST = {
    "LM head": (0.14, 0.10),
    "add+RMSNorm": (0.11, 0.04),
    "sampler": (0.085, 0.03),
    "SiLU-and-mul": (0.053, 0.04),
    "between kernels": (0.21, 0.0),
}
PARTS = {
    "bf16": {"attention": (7.03, 7.03 * 2.90 / 3.04), **PROJECTIONS, **REST},
    "fp8": {"attention": (3.84, 3.84 * 2.82 / 2.90), **PROJECTIONS, "norm+RoPE+store": (0.15, 0.02), **REST},
}
COLORS = {"attention": "#4c72b0", "projections": "#dd8452", "LM head": "#55a868", "add+RMSNorm": "#c44e52",
          "sampler": "#8172b3", "SiLU-and-mul": "#937860", "between kernels": "#bbbbbb",
          "norm+RoPE+store": "#da8bc3"}


def main() -> None:
    fig, axes = plt.subplots(2, 1, figsize=(12, 4.8))
    for ax, (dtype, parts) in zip(axes, PARTS.items()):
        for row, column in ((1, 0), (0, 1)):  # measured on top, floor below
            left = 0.0
            for name, values in parts.items():
                width = values[column]
                ax.barh(row, width, left=left, color=COLORS[name], edgecolor="white",
                        label=name if column == 0 else None)
                left += width
            ax.text(left + 0.05, row, f"{left:.2f} ms", va="center", fontsize=9)
        ax.set_yticks([1, 0], ["measured", "floor"])
        ax.set_title(f"{dtype} KV cache: one decode step of 256 sequences (H100)", fontsize=10, loc="left")
        ax.set_xlim(0, 9.5)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    axes[-1].set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_step.png"), dpi=120)


if __name__ == "__main__":
    main()
