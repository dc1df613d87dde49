"""On the CPU, keep freed memory in the process instead of handing it back to the OS at every free.

A CPU forward allocates every activation afresh (torch has no caching allocator there). glibc
serves blocks above its mmap threshold (128 KiB at start, rising towards the largest block freed)
with mmap and unmaps them at free, and trims its heap whenever more than 128 KiB is free at its
top. Either way the next op's output lands on pages the kernel must fault in and zero again, one
by one: an RMSNorm over [3200, 576] bf16 took 4.0 ms, 1.5 ms with freed memory kept. SmolLM2-135M
on a 2-core Sapphire Rapids, 64 requests, alternating runs: bf16 +2-5%, fp32 +8-9% output tok/s
(benchmarks/RESULTS.md). (vLLM's CPU guide has users preload tcmalloc for the same reason.)

So a worker on the CPU raises the mmap threshold to glibc's cap (blocks up to 32 MiB come from the
heap and are reused) and the trim threshold to 1 GiB. Setting only the trim threshold would be
worse than nothing: it also freezes the mmap threshold at 128 KiB (measured: 235 tok/s).

Skipped where the user chose already (a MALLOC_* tunable in the environment, or a preloaded
malloc such as tcmalloc or jemalloc), off glibc, and with MINIVLLM_CPU_KEEP_FREED_MEMORY=0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

ENV = "MINIVLLM_CPU_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2); mallopt refuses more
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Set the thresholds for this process (see the module docstring); whether they were set."""
    if os.environ.get(ENV, "1") == "0":
        return False
    if any(name.startswith("MALLOC_") for name in os.environ) or "malloc" in os.environ.get("LD_PRELOAD", ""):
        logger.info("malloc: left as configured (MALLOC_* or a preloaded allocator in the environment)")
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        logger.warning("malloc: glibc refused the thresholds; activations are faulted in afresh each step")
        return False
    logger.debug("malloc: freed blocks up to %d MiB are kept for reuse", MMAP_THRESHOLD >> 20)
    return True
