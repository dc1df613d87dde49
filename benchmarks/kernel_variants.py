"""Builds of the engine's CUDA sources with text edits, for probes that time a variant of a kernel.

Each edit must apply exactly once (a probe whose anchor text moved fails with the text, rather than
timing the unedited kernel). A build lands under $MINIVLLM_CACHE/kernels/<tag>/<hash of the text>/,
beside a copy of hopper_gemm.cu's header, so a machine builds each variant once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
from collections.abc import Callable

from minivllm.protocol.config import cache_root
from minivllm.worker import hopper_gemm
from minivllm.worker.attention.cuda_build import compile_library, find_nvcc


def edited_text(source: str, edits: list[tuple[str, str]]) -> str:
    """source's text with `edits` (each (old, new); old must occur once)."""
    with open(source) as f:
        text = f.read()
    for old, new in edits:
        assert text.count(old) == 1, f"{os.path.basename(source)} changed; the probe's edit no longer applies: {old!r}"
        text = text.replace(old, new)
    return text


def built_text(text: str, name: str, loader: Callable[[str], ctypes.CDLL], tag: str) -> ctypes.CDLL:
    """A kernel source's text (file name `name`) built once per machine under
    $MINIVLLM_CACHE/kernels/tag/, and loaded by `loader`."""
    directory = os.path.join(str(cache_root()), "kernels", tag, hashlib.sha1(text.encode()).hexdigest()[:12])
    target = os.path.join(directory, name.replace(".cu", ".so"))
    if not os.path.exists(target):
        os.makedirs(directory, exist_ok=True)
        if '#include "hopper_ptx.cuh"' in text:  # (from the engine's tree: the source may be a copy elsewhere)
            shutil.copy(os.path.join(os.path.dirname(hopper_gemm.SOURCE), "hopper_ptx.cuh"), directory)
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
        compile_library(find_nvcc(), os.path.join(directory, name), target + ".tmp")
        os.replace(target + ".tmp", target)
    return loader(target)
