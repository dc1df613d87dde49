"""The hand-written kernels' sources: a build's fingerprint covers the headers a source includes,
and every source ships with the package (a wheel, not only an editable install)."""

from __future__ import annotations

import fnmatch
import os
import tomllib

from minivllm.worker.attention import cuda_build

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNEL_SUFFIXES = (".cu", ".cuh", ".cpp")


def test_a_build_fingerprints_the_headers_its_source_includes(tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    source = tmp_path / "kernel.cu"
    source.write_text('#include <stdint.h>\n#include "sub/helpers.cuh"\n__global__ void k() {}\n')
    (tmp_path / "sub" / "helpers.cuh").write_text('#pragma once\n  #  include "../common.cuh"\n')
    (tmp_path / "common.cuh").write_text("#pragma once\n// v1\n")
    assert sorted(cuda_build.source_files(str(source))) == sorted(
        str(tmp_path / name) for name in ("kernel.cu", "sub/helpers.cuh", "common.cuh"))

    before = cuda_build.build_name(str(source), "k", "nvcc 13.0")
    assert before == cuda_build.build_name(str(source), "k", "nvcc 13.0")
    assert before != cuda_build.build_name(str(source), "k", "nvcc 13.1")
    (tmp_path / "common.cuh").write_text("#pragma once\n// v2\n")  # a header two includes deep
    assert cuda_build.build_name(str(source), "k", "nvcc 13.0") != before


def test_the_packages_kernel_sources_include_only_files_that_exist() -> None:
    for source in ("worker/hopper_gemm.cu", "worker/attention/hopper_prefill.cu", "worker/attention/fp8_decode.cu"):
        for path in cuda_build.source_files(os.path.join(REPO, source)):
            assert os.path.exists(path), f"{source} includes {path}, which does not exist"


def test_every_kernel_source_ships_with_the_package() -> None:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    unshipped = []
    for directory, _, files in os.walk(REPO):
        relative = os.path.relpath(directory, REPO)
        if relative.split(os.sep)[0] not in ("worker", "core", "frontend", "protocol"):
            continue
        package = ".".join(["minivllm", *relative.split(os.sep)])
        for name in files:
            if name.endswith(KERNEL_SUFFIXES) and not any(
                    fnmatch.fnmatch(name, pattern) for pattern in package_data.get(package, [])):
                unshipped.append(os.path.join(relative, name))
    assert not unshipped, f"kernel sources missing from [tool.setuptools.package-data]: {unshipped}"
