"""One import package: a built wheel installs `minivllm` and nothing else of ours, and the engine's
child processes start from whichever copy of minivllm their parent runs (a regular install here;
the editable install is what the rest of the suite runs on; a checkout through bin/minivllm)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGE_DIRS = ("frontend", "core", "worker", "protocol")

# Run in a fresh interpreter from a directory outside the checkout. argv: mode ("installed" or
# "checkout"), the bin/minivllm to bootstrap from (checkout mode), a tiny model directory.
PROBE = r"""
import json, os, runpy, sys

mode, bin_script, model = sys.argv[1:4]
if mode == "checkout":
    runpy.run_path(bin_script)  # its bootstrap loads `minivllm` from its checkout (main() is not run)

import minivllm
from minivllm import (LLM, AsyncLLM, SamplingParams, RequestOutput, CompletionOutput, BeamSearchParams,
                      RequestOutputKind, EngineDeadError)
import minivllm.frontend, minivllm.core, minivllm.worker, minivllm.protocol

generic_imports = {}
for name in ("core", "frontend", "protocol", "worker"):
    try:
        __import__(name)
        generic_imports[name] = sys.modules[name].__file__
    except ImportError:
        pass


def descendants(pid):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().split(b"\0")
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(ppid, []).append((int(entry), [a.decode(errors="replace") for a in cmdline]))
    found, frontier = [], [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child[1])
            frontier.append(child[0])
    return found


with LLM(model, max_model_len=64) as llm:
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    children = descendants(os.getpid())
print(json.dumps({
    "package_file": minivllm.__file__,
    "llm_module": LLM.__module__,
    "token_ids": list(out.outputs[0].token_ids),
    "generic_imports": generic_imports,
    "children": children,
}))
"""


def _probe(tmp_path: Path, mode: str, bin_script: str, model: str, env: dict[str, str]) -> dict:
    outside = tmp_path / "elsewhere"
    outside.mkdir(exist_ok=True)
    result = subprocess.run([sys.executable, "-c", PROBE, mode, bin_script, model], cwd=outside, env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def _child_modules(children: list[list[str]]) -> dict[str, str]:
    """module run -> package dir it was loaded from, for each minivllm child (see protocol/ipc.py)."""
    found = {}
    for argv in children:
        if len(argv) > 4 and argv[1] == "-c" and argv[4].startswith("minivllm."):
            found[argv[4]] = argv[3]
    return found


def _expected_greedy_tokens(model: str) -> list[int]:
    from minivllm import LLM, SamplingParams

    with LLM(model, max_model_len=64) as llm:
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def _copy_checkout(dest: Path) -> None:
    shutil.copytree(REPO_ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".whl", "benchmarks", "tests"))


def test_wheel_installs_one_package_and_its_children_run_from_it(tmp_path: Path, tiny_llama: str) -> None:
    source = tmp_path / "source"
    _copy_checkout(source)  # build from a copy: setuptools writes build/ and *.egg-info beside the sources
    wheel_dir = tmp_path / "wheels"
    # No build isolation: the setuptools the test environment already has (torch depends on it) builds it.
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                            "-w", str(wheel_dir)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = wheel_dir.glob("minivllm-*.whl")

    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names}
    assert top_level == {"minivllm", next(t for t in top_level if t.endswith(".dist-info"))}, top_level
    # Every subpackage of the checkout is in the wheel (pyproject.toml lists them by hand).
    for sub in SUBPACKAGE_DIRS:
        for init in (REPO_ROOT / sub).rglob("__init__.py"):
            rel = init.relative_to(REPO_ROOT).as_posix()
            assert f"minivllm/{rel}" in names, f"{rel} is missing from the wheel: list it in pyproject.toml"
    assert "minivllm/__init__.py" in names
    assert "minivllm/worker/attention/cpu_decode.cpp" in names  # (built on the machine that runs it)

    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile",
                              "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    entry_points = next(target.glob("minivllm-*.dist-info")).joinpath("entry_points.txt").read_text()
    assert "minivllm = minivllm.frontend.cli:main" in entry_points

    env = _clean_env()
    env["PYTHONPATH"] = str(target)  # ahead of site-packages, and of the editable install's finder
    probe = _probe(tmp_path, "installed", "", tiny_llama, env)
    installed_dir = str(target / "minivllm")
    assert probe["package_file"] == os.path.join(installed_dir, "__init__.py")
    assert probe["llm_module"] == "minivllm.frontend.llm"
    assert probe["generic_imports"] == {}, "an install must not answer to core/frontend/protocol/worker"
    children = _child_modules(probe["children"])
    assert children == {"minivllm.core.engine_core": installed_dir, "minivllm.worker.worker": installed_dir}
    assert probe["token_ids"] == _expected_greedy_tokens(tiny_llama)


def test_checkout_bin_runs_its_own_copy_and_children_follow(tmp_path: Path, tiny_llama: str) -> None:
    checkout = tmp_path / "any-name-but-minivllm"  # the directory's name must not matter
    _copy_checkout(checkout)
    bin_script = str(checkout / "bin" / "minivllm")
    probe = _probe(tmp_path, "checkout", bin_script, tiny_llama, _clean_env())
    assert probe["package_file"] == str(checkout / "__init__.py")
    children = _child_modules(probe["children"])
    assert children == {"minivllm.core.engine_core": str(checkout), "minivllm.worker.worker": str(checkout)}
    assert probe["token_ids"] == _expected_greedy_tokens(tiny_llama)

    # And the command itself, from elsewhere.
    result = subprocess.run([sys.executable, bin_script, "generate", "--model", tiny_llama, "--no-chat",
                             "--max-tokens", "4", "--max-model-len", "64", "Hello"],
                            cwd=tmp_path / "elsewhere", env=_clean_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()


@pytest.mark.parametrize("name", SUBPACKAGE_DIRS)
def test_editable_install_answers_to_minivllm_only(tmp_path: Path, name: str) -> None:
    """The editable install this suite runs on: `minivllm` is this checkout, the generic names are nothing."""
    code = (f"import importlib.util, minivllm; print(minivllm.__file__); "
            f"print(importlib.util.find_spec({name!r}) is None)")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_clean_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    package_file, generic_missing = result.stdout.split()
    assert package_file == str(REPO_ROOT / "__init__.py")
    assert generic_missing == "True"


def test_public_names_resolve_lazily_and_core_stays_torch_free() -> None:
    import minivllm

    assert set(minivllm.__all__) - {"__version__"} == set(minivllm._EXPORTS)
    for name in minivllm._EXPORTS:
        assert getattr(minivllm, name).__name__ == name
    # Importing the package itself pulls in no frontend (nor torch): the EngineCore relies on it.
    code = "import minivllm, minivllm.core.engine_core, sys; print('torch' in sys.modules, 'minivllm.frontend' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["False", "False"], result.stderr
