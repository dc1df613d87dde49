"""Shared pytest fixtures: repo root on sys.path, and tiny random HF checkpoints built once per session."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from tests.tiny_models import ARCHS, TINY_CHAT_TEMPLATE, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`tiny_model_factory(arch="llama", seed=0, chat_template=None, **config_overrides) -> model dir`.

    Each distinct (arch, seed, overrides) is built once per session and reused.
    """
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, str] = {}

    def factory(arch: str = "llama", seed: int = 0, chat_template: str | None = None, **config_overrides: Any) -> str:
        key = json.dumps([arch, seed, chat_template, config_overrides], sort_keys=True)
        if key not in cache:
            path = str(root / f"{arch}-{seed}-{len(cache)}")
            cache[key] = build_tiny_model(path, arch=arch, seed=seed, chat_template=chat_template, **config_overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[..., str]) -> str:
    """The default tiny Llama model directory."""
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_chat_llama(tiny_model_factory: Callable[..., str]) -> str:
    """The default tiny Llama with a chat template (TINY_CHAT_TEMPLATE)."""
    return tiny_model_factory("llama", chat_template=TINY_CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The default model (SmolLM2-135M-Instruct) converted into the model cache: the first run on
    a machine fetches and converts it (~40 s), later runs reuse it. MINIVLLM_CACHE applies."""
    from minivllm.frontend.model_download import download_default_model

    return str(download_default_model())


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., str]) -> str:
    """A tiny model directory, parametrized over every arch in tests.tiny_models.ARCHS."""
    return tiny_model_factory(request.param)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one test process more than the cores, at most 4. Most of the suite's time is
    end-to-end tests that start engines and servers (2-7 processes; importing torch is most of a
    start) and then partly wait on them, so a third process keeps two cores busy. On a 2-core box
    (CI's size) the suite took 777 s in one process, 561 s in 2 and 492 s in 3."""
    return max(1, min((os.cpu_count() or 1) + 1, 4))


def pytest_configure(config: pytest.Config) -> None:
    """Under `-n`, each test process (and the engines it starts, through OMP_NUM_THREADS) gets its
    share of the cores, unless OMP_NUM_THREADS is set already: two processes each running a thread
    per core spin against each other (an HF reference generation took 27 s in place of 6)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)
