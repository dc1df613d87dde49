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

from tests.tiny_models import ARCHS, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`tiny_model_factory(arch="llama", seed=0, **config_overrides) -> model dir`.

    Each distinct (arch, seed, overrides) is built once per session and reused.
    """
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, str] = {}

    def factory(arch: str = "llama", seed: int = 0, **config_overrides: Any) -> str:
        key = json.dumps([arch, seed, config_overrides], sort_keys=True)
        if key not in cache:
            path = str(root / f"{arch}-{seed}-{len(cache)}")
            cache[key] = build_tiny_model(path, arch=arch, seed=seed, **config_overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[..., str]) -> str:
    """The default tiny Llama model directory."""
    return tiny_model_factory("llama")


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., str]) -> str:
    """A tiny model directory, parametrized over every arch in tests.tiny_models.ARCHS."""
    return tiny_model_factory(request.param)
