"""worker/cpu_malloc.py: a CPU worker keeps freed activation-sized blocks in the heap (glibc's
mmap threshold raised), unless the environment already chose the allocator or opts out."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from minivllm.worker import cpu_malloc

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")

# How many MiB of mmapped blocks a fresh 16 MiB tensor adds (mallinfo2's hblkhd), after `setup`.
PROBE = """
import ctypes, torch
from minivllm.worker.cpu_malloc import keep_freed_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
print(keep_freed_memory())
before = libc.mallinfo2().hblkhd
block = torch.empty(16 << 20, dtype=torch.uint8)
print((libc.mallinfo2().hblkhd - before) >> 20)
"""


def probe(**env: str) -> tuple[str, int]:
    clean = {name: value for name, value in os.environ.items()
             if not name.startswith("MALLOC_") and name not in ("LD_PRELOAD", cpu_malloc.ENV)}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], int(out[1])


@glibc
def test_a_block_under_32_mib_comes_from_the_heap_once_set() -> None:
    assert probe() == ("True", 0)
    # Opted out: glibc's own threshold (128 KiB in a fresh process) maps the block.
    assert probe(**{cpu_malloc.ENV: "0"}) == ("False", 16)


@glibc
def test_the_environments_allocator_choice_is_left_alone() -> None:
    assert probe(MALLOC_ARENA_MAX="2")[0] == "False"


def test_a_preloaded_allocator_is_left_alone(monkeypatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    assert not cpu_malloc.keep_freed_memory()
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv(cpu_malloc.ENV, "0")
    assert not cpu_malloc.keep_freed_memory()
