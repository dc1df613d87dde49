"""Decode attention on the CPU straight from the paged cache: cpu_decode.cpp, built at worker start.

A CPU decode step's attention through SDPA pays twice: every layer copies each sequence's K/V out
of the cache blocks into contiguous tensors (an index_select as long as the whole read), then runs
a flash kernel whose set-up per (sequence, head) outweighs one query's work. The C++ kernel reads
each key and value once, in place, for the query heads that share it.

torch's C++ extension builder compiles it when a CPU worker with a 16-bit cache starts and no
build is there yet (~25 s on a 2-core box; it needs a C++ compiler with OpenMP, and ninja), for the
CPU it runs on (-march=native), into `$MINIVLLM_CACHE/kernels/` (default `~/.cache/minivllm`).
The build's name carries the source's, torch's and the CPU's fingerprints, so a changed source, a
new torch or another machine sharing the directory gets its own. If the build fails the worker
logs why once and stays on SDPA. $MINIVLLM_CPU_DECODE_KERNEL=0 keeps SDPA (for measuring).

It serves 16-bit caches (bfloat16, float16) with head_dim 64 or 128. float32 stays on SDPA, whose
results the CPU exactness tests pin against HF; an FP8 cache stays on the dequantizing gather.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import tempfile
import time
from types import ModuleType

import torch

from minivllm.protocol.config import cache_root
from minivllm.worker.attention.kv_cache import KVCacheLayout, KVCacheViews

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("MINIVLLM_CPU_DECODE_KERNEL", "1") != "0"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_decode.cpp")
DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)  # the head sizes cpu_decode.cpp is instantiated for


def _build_name() -> str:
    """What the build depends on: the source, this torch and Python, the machine and its CPU's
    feature flags (-march=native)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = f"{platform.machine()} {flags} {torch.__version__} {sys.version_info[:2]}".encode() + source
    return f"minivllm_cpu_decode_{hashlib.sha1(key).hexdigest()[:16]}"


def _load(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def extension() -> ModuleType | None:
    """The built kernel, or None if it cannot be built here (said once, in the log). A build goes to
    a directory of its own and is then renamed into place, so processes building at once never
    wait on each other's locks (nor on one a killed build left behind)."""
    try:
        name = _build_name()
        kernels = str(cache_root() / "kernels")
        built = os.path.join(kernels, f"{name}.so")
        if os.path.exists(built):
            return _load(name, built)
        from torch.utils.cpp_extension import load

        os.makedirs(kernels, exist_ok=True)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=kernels) as build_dir:
            module = load(name=name, sources=[SOURCE], build_directory=build_dir, verbose=False,
                          extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"])
            os.replace(os.path.join(build_dir, f"{name}.so"), built)
        logger.info("built the CPU decode attention kernel in %.0f s: %s", time.perf_counter() - started, built)
        return module
    except Exception as e:  # no compiler, no ninja, a failed build: SDPA serves
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        logger.warning("the CPU decode attention kernel (%s) did not build, so decode attention runs through "
                       "SDPA: %s", SOURCE, reason)
        return None


def prepare(layout: KVCacheLayout) -> None:
    """Build (or load) the kernel now if this cache's decodes would use it: at start-up rather than
    in the first decode step."""
    if ENABLED and _serves(layout.dtype, layout.head_dim, layout.fp8):
        extension()


def _serves(dtype: torch.dtype, head_dim: int, fp8: bool) -> bool:
    return dtype in DTYPES and head_dim in HEAD_DIMS and not fp8


def supports(query: torch.Tensor, layout: KVCacheLayout) -> bool:
    """Whether this step's decodes can go through the kernel (building it if need be)."""
    return (ENABLED and query.device.type == "cpu" and _serves(query.dtype, query.shape[-1], layout.fp8)
            and extension() is not None)


def decode_attention(query: torch.Tensor, views: KVCacheViews, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     rows: torch.Tensor, seqs: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out[rows[i]] = attention of query[rows[i]] over the seq_lens[seqs[i]] cached keys and values
    of sequence seqs[i] (its block_tables row), for every i (supports() must hold)."""
    extension().paged_decode_attention(query, views.key, views.value, block_tables.to(torch.int32).contiguous(),
                                       seq_lens.to(torch.int32).contiguous(), rows, seqs, scale, out)
