"""Build a CUDA source of this package into a shared library at worker start, once per machine.

The kernels written in CUDA (hopper_gemm.cu, hopper_prefill.cu, fp8_decode.cu) take plain pointers
and a stream and are loaded with ctypes, so they need no torch headers: nvcc builds one in seconds.
A build goes to `$MINIVLLM_CACHE/kernels/` under a name that fingerprints the source, the files it
includes with `#include "..."` (hopper_ptx.cuh) and nvcc, built in a directory of its own and
renamed into place, so concurrent builds never wait on a lock.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable

from minivllm.protocol.config import cache_root

logger = logging.getLogger(__name__)


def find_nvcc() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    found = shutil.which("nvcc")
    if found is None and CUDA_HOME is not None and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        found = os.path.join(CUDA_HOME, "bin", "nvcc")
    return found


def compile_library(nvcc: str, source: str, target: str) -> str:
    """nvcc source into the shared library target (sm_90a); returns ptxas' report (registers,
    spills). Raises RuntimeError with nvcc's message if it fails."""
    result = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-shared",
                             "-Xcompiler", "-fPIC", "-Xptxas", "-v", "-o", target, source],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed: {result.stderr.strip()[-2000:]}")
    return result.stderr


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_files(source: str) -> list[str]:
    """source and the files it includes with `#include "..."` (relative to the including file, as
    nvcc finds them), transitively: what a build's fingerprint covers."""
    files, pending = [], [os.path.abspath(source)]
    while pending:
        path = pending.pop()
        if path in files:
            continue
        files.append(path)
        with open(path, "rb") as f:
            text = f.read()
        directory = os.path.dirname(path)
        pending.extend(os.path.normpath(os.path.join(directory, name.decode())) for name in _LOCAL_INCLUDE.findall(text))
    return files


def build_name(source: str, stem: str, nvcc_version: str) -> str:
    """The file name (without .so) of source's build: stem and a fingerprint of nvcc's version and
    of source_files(source)."""
    digest = hashlib.sha1(nvcc_version.encode())
    for path in source_files(source):
        with open(path, "rb") as f:
            digest.update(f.read())
    return f"{stem}_{digest.hexdigest()[:16]}"


def built_library(source: str, stem: str, what: str) -> str:
    """The path of source's build (building it now if this machine has none); `stem` prefixes its
    file name, `what` names the kernel in the log. Raises RuntimeError where it cannot be built."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (on PATH or under CUDA_HOME)")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    name = build_name(source, stem, version)
    kernels = str(cache_root() / "kernels")
    built = os.path.join(kernels, f"{name}.so")
    if not os.path.exists(built):
        os.makedirs(kernels, exist_ok=True)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=kernels) as build_dir:
            target = os.path.join(build_dir, f"{name}.so")
            compile_library(nvcc, source, target)
            os.replace(target, built)
        logger.info("built the %s in %.1f s: %s", what, time.perf_counter() - started, built)
    return built


def library_or_none(source: str, stem: str, what: str, load: Callable[[str], ctypes.CDLL],
                    fallback: str) -> ctypes.CDLL | None:
    """load(built_library(...)): the kernel, or None where it cannot be built (no nvcc, a failed
    build), said once in the log with `fallback`, what serves instead."""
    try:
        return load(built_library(source, stem, what))
    except Exception as e:
        text = str(e).strip()
        logger.warning("the %s (%s) did not build, so %s: %s", what, source, fallback,
                       text.splitlines()[-1] if text else type(e).__name__)
        return None
