"""The garbage collector in the engine's own processes: their start-up heap frozen once they are up.

CPython's cyclic collector runs a full pass (generation 2) every so many allocations, and a full pass
walks every tracked object in the process. Once up, an EngineCore holds 64-101k of them and a worker
~207k (torch, transformers, Triton, the model's modules). In a traced run of `bench throughput`'s 256
requests on an H100 (FP8 cache) the EngineCore made two full passes of ~25 ms, and the GPU ran out
of queued steps meanwhile (benchmarks/RESULTS.md, 2026-11-27, twenty-fourth session). gc.freeze()
moves the objects alive at that point into a permanent generation that later passes skip; they are
still freed by reference counting as usual.

Only for processes of the engine's own (the EngineCore, its workers, `minivllm serve`), never a
user's process that merely holds an LLM: there it would keep whatever cycles the user's objects form
later out of the collector's reach. $MINIVLLM_GC_FREEZE=0 leaves the collector alone (for measuring).
"""

from __future__ import annotations

import gc
import logging
import os
import time

logger = logging.getLogger(__name__)

GC_FREEZE_ENV = "MINIVLLM_GC_FREEZE"


def freeze_gc_heap(who: str) -> int:
    """Collect once, then freeze every object alive now; returns how many are frozen in all (0 where
    $MINIVLLM_GC_FREEZE=0). Call once the process's start-up is done (`who` names it in the log)."""
    if os.environ.get(GC_FREEZE_ENV, "1") == "0":
        return 0
    start = time.perf_counter()
    gc.collect()  # what is garbage now would otherwise stay, frozen, for the process's life
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d objects moved out of the garbage collector's passes (%.0f ms)", who, frozen,
                (time.perf_counter() - start) * 1e3)
    return frozen
