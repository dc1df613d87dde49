"""Programmatic dependent launch (PDL, Hopper and later), for the kernels of a small decode step.

In a batch-1 step every kernel is short (a few microseconds), so the gap between one kernel's end
and the next one's first loads is a large share of the step. With PDL a kernel is launched with
`launch_pdl=True` and may start while the kernel before it still runs: it calls
`gdc_launch_dependents()` at its start (so the kernel after it may start early too), loads what no
earlier kernel of the step writes (weights, cos/sin tables, the step's host-copied inputs), then
`gdc_wait()`s for the previous kernel to finish before it reads that kernel's outputs or writes
anything. Every kernel launched with PDL must wait (in every program) before its first dependent
access: that keeps the order transitive down the chain.

On by default on Hopper and later; MINIVLLM_PDL=0 turns it off. It pays once the one-row
projections leave the next kernel room to start (worker/small_batch_gemm.py, TILINGS): batch-1
decode on an H100 0.880 ms per token against 1.000-1.003 without (benchmarks/RESULTS.md). With
the projections filling every multiprocessor's registers, as before, it gained nothing.
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("MINIVLLM_PDL", "1") != "0"


@functools.cache
def _capability(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


@functools.cache
def num_sms(device_index: int) -> int:
    """The device's multiprocessor count (grids are sized by it, PDL or not)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL."""
    return ENABLED and device.type == "cuda" and _capability(device.index or 0) >= 9


OFF = {"PDL": False}


def launch_options(device: torch.device) -> dict:
    """The kernel's PDL constexpr and Triton's launch option, for `kernel[grid](..., **launch_options(dev))`."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else OFF
