"""The model cache: built once, published whole, broken copies detected and rebuilt (no torch)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from minivllm.frontend.model_cache import MANIFEST_NAME, ModelCacheError, build_cached, cache_root, check_model_dir


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


class FakeBuilder:
    """Writes a small 'model' and counts how often it was asked to."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, out_dir: Path) -> None:
        self.calls += 1
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        (out_dir / "model.safetensors").write_bytes(os.urandom(4096))


def rewrite_same_size(path: Path) -> None:
    before = path.stat().st_mtime_ns
    path.write_bytes(b"\0" * path.stat().st_size)
    # File systems stamp mtimes with a coarse clock: make sure this rewrite is visible as one.
    os.utime(path, ns=(before + 10**9, before + 10**9))


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(".lock"))


def test_cache_root_is_minivllm_cache_or_home(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_root() == cache
    monkeypatch.delenv("MINIVLLM_CACHE")
    assert cache_root() == Path.home() / ".cache" / "minivllm"


def test_built_once_then_reused(cache: Path) -> None:
    build = FakeBuilder()
    first = build_cached("m", build, source={"test": 1})
    assert first == cache / "models" / "m" and check_model_dir(first) is None
    assert (first / MANIFEST_NAME).is_file()
    assert build_cached("m", build, source={"test": 1}) == first
    assert build.calls == 1
    assert entries(cache / "models") == ["m"]  # no temp dirs left behind


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: os.truncate(d / "model.safetensors", 100), "truncated"),
        (lambda d: (d / "config.json").unlink(), "missing"),
        (lambda d: (d / MANIFEST_NAME).unlink(), "no manifest"),
        (lambda d: (d / MANIFEST_NAME).write_text("{not json"), "unreadable"),
        # Same size, different bytes: caught by re-hashing the file whose mtime changed.
        (lambda d: rewrite_same_size(d / "model.safetensors"), "modified"),
        (lambda d: (d / "model-00002.safetensors").write_bytes(b"x"), "does not list"),
    ],
    ids=["truncated", "file-missing", "manifest-missing", "manifest-garbled", "modified", "extra-file"],
)
def test_broken_cache_dir_is_detected_and_rebuilt(damage, reason: str) -> None:
    build = FakeBuilder()
    model_dir = build_cached("m", build, source={})
    damage(model_dir)
    assert reason in (check_model_dir(model_dir) or "")
    assert build_cached("m", build, source={}) == model_dir
    assert build.calls == 2
    assert check_model_dir(model_dir) is None
    assert entries(model_dir) == sorted(["config.json", "model.safetensors", MANIFEST_NAME])


def test_failed_build_leaves_nothing_and_stale_temp_dirs_are_cleaned(cache: Path) -> None:
    def failing(out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("conversion blew up")

    with pytest.raises(RuntimeError, match="blew up"):
        build_cached("m", failing, source={})
    assert entries(cache / "models") == []
    # A build killed outright (no exception handler ran) leaves its temp dir; the next build removes it.
    (cache / "models" / ".tmp-m-killed").mkdir()
    build_cached("m", FakeBuilder(), source={})
    assert entries(cache / "models") == ["m"]


def test_disk_full_is_a_clear_error(cache: Path) -> None:
    def disk_full(out_dir: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(ModelCacheError, match="no space left.*MINIVLLM_CACHE"):
        build_cached("m", disk_full, source={})
    assert entries(cache / "models") == []


def test_force_rebuilds_a_valid_dir() -> None:
    build = FakeBuilder()
    build_cached("m", build, source={})
    build_cached("m", build, source={}, force=True)
    assert build.calls == 2
