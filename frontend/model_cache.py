"""The on-disk cache of converted models: `$MINIVLLM_CACHE/models/<name>/` (default
`~/.cache/minivllm`).

A cached model directory is only ever published whole: it is built in a temp directory next to
it, a manifest listing every file's size and sha256 is written last, and the temp directory is
renamed into place. A directory whose manifest is missing or disagrees with the files (a
truncated copy, a file edited or deleted) is treated as absent and rebuilt.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from minivllm.protocol.config import cache_root

logger = logging.getLogger(__name__)

MANIFEST_NAME = "minivllm-manifest.json"
MANIFEST_FORMAT = 1


class ModelCacheError(RuntimeError):
    """Preparing a model failed for a reason the user can act on (the message says how)."""


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(model_dir: Path, source: dict[str, Any]) -> None:
    """Record every file of `model_dir` (size, sha256, mtime). Written last: its presence says
    the directory is complete."""
    files = {}
    for path in sorted(model_dir.iterdir()):
        if path.name == MANIFEST_NAME or not path.is_file():
            continue
        stat = path.stat()
        files[path.name] = {"size": stat.st_size, "sha256": sha256_file(path), "mtime_ns": stat.st_mtime_ns}
    manifest = {"format": MANIFEST_FORMAT, "created": time.time(), "source": source, "files": files}
    tmp = model_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, model_dir / MANIFEST_NAME)


def check_model_dir(model_dir: Path) -> str | None:
    """Why `model_dir` is not a complete cached model, or None when it is.

    Sizes are always compared. Hashing ~0.5 GB on every start would cost ~1 s, so a file is
    re-hashed only when its mtime differs from the manifest's (anything that rewrote it).
    """
    try:
        manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not files:
            return "its manifest is of an unknown format"
    except FileNotFoundError:
        return "it has no manifest (an interrupted build)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest is unreadable ({e})"
    for name, expected in files.items():
        path = model_dir / name
        try:
            stat = path.stat()
        except FileNotFoundError:
            return f"{name} is missing"
        if stat.st_size != expected["size"]:
            return f"{name} has {stat.st_size} bytes, expected {expected['size']} (truncated?)"
        if stat.st_mtime_ns != expected["mtime_ns"] and sha256_file(path) != expected["sha256"]:
            return f"{name} was modified (its sha256 differs from the manifest)"
    extra = [p.name for p in model_dir.iterdir() if p.is_file() and p.name not in files
             and p.name != MANIFEST_NAME and not p.name.startswith(".")]
    if extra:
        return f"it holds files the manifest does not list: {', '.join(sorted(extra))}"
    return None


def build_cached(
    name: str, build: Callable[[Path], None], *, source: dict[str, Any], force: bool = False
) -> Path:
    """The cached model directory `name`, built with `build(empty_dir)` if missing or broken.

    Concurrent callers (two `minivllm generate` on a cold cache) serialize on a lock file, so
    the model is built once.
    """
    final = cache_root() / "models" / name
    if not force and check_model_dir(final) is None:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(final.parent / f".{name}.lock"):
        reason = check_model_dir(final) if final.exists() else None
        if not force and final.exists() and reason is None:
            return final  # another process built it while we waited
        if reason is not None:
            logger.warning("The cached model %s is unusable (%s); rebuilding it.", final, reason)
        _remove_stale_temp_dirs(final.parent, name)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; a model cache may be shared
        try:
            build(tmp)
            write_manifest(tmp, source)
            if final.exists():  # broken (or forced): move it aside, then swap the new one in
                trash = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-old-", dir=final.parent))
                os.rename(final, trash / "model")
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if not isinstance(e, ModelCacheError) and _is_disk_full(e):
                raise ModelCacheError(
                    f"no space left on the device while writing {final}. Free some disk space, or set "
                    f"MINIVLLM_CACHE to a directory on a disk with room, then try again."
                ) from e
            raise
    logger.info("Cached model ready at %s", final)
    return final


def _is_disk_full(error: BaseException | None) -> bool:
    """ENOSPC, also when a library wrapped it (safetensors reports it as its own error type)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error) or "StorageFull" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _remove_stale_temp_dirs(parent: Path, name: str) -> None:
    """Temp dirs left by a build that was killed (we hold the lock, so none is in use)."""
    for stale in parent.glob(f".tmp-{name}-*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock; the rename is still atomic
        yield
        return
    with open(path, "a") as f:
        if _try_lock(fcntl, f):
            yield
            return
        logger.info("Waiting for another process that is preparing the same model (%s) ...", path)
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _try_lock(fcntl: Any, f: Any) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
