"""Builds the kernel variants variants.py times, from branch qkv-rope-epilogue's hopper_gemm.cu at
f431586 ("full") and 8ba1e24 ("prev"): each leaves one stage out. Run from the repository root on a
machine with nvcc (the .so files run on the H100 as built here with nvcc 13.0):
    python benchmarks/results/2026-11-27-qkv-rope-epilogue/make_variants.py .devtmp/s37/var"""
import os, shutil, subprocess, sys
from concurrent.futures import ThreadPoolExecutor


def show(rev: str) -> str:
    """hopper_gemm.cu at commit rev."""
    return subprocess.run(["git", "show", f"{rev}:worker/hopper_gemm.cu"], capture_output=True, text=True,
                          check=True).stdout


def build_all(out: str, variants: dict[str, str]) -> None:
    """Each source as out/<name>.cu and its library out/<name>.so (nvcc for sm_90a), beside hopper_ptx.cuh."""
    os.makedirs(out, exist_ok=True)
    shutil.copy("worker/hopper_ptx.cuh", out)

    def build(name: str) -> None:
        path = os.path.join(out, f"{name}.cu")
        with open(path, "w") as f:
            f.write(variants[name])
        subprocess.run(["nvcc", "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-shared",
                        "-Xcompiler", "-fPIC", "-o", os.path.join(out, f"{name}.so"), path], check=True,
                       capture_output=True)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(build, variants))


def variants() -> dict[str, str]:
    src = show("f431586")
    sync = 'asm volatile("bar.sync 2, 320;\\n" ::: "memory");'
    arrive = 'asm volatile("bar.arrive 2, 320;\\n" ::: "memory");'
    stage, epilogue = "stage_cos_sin<BT>(reinterpret_cast", "rope_epilogue<BT>(d,"
    assert all(src.count(s) == 1 for s in (sync, arrive, stage, epilogue))
    variants = {"prev": show("8ba1e24"), "full": src,
                # consumers stage their sums and wait for the cos/sin, then leave
                "no_epilogue_math": src.replace(sync, sync + " return;")}
    variants["no_math_no_cos_sin"] = variants["no_epilogue_math"].replace(stage, "if (false) " + stage)
    variants["main_loop_only"] = src.replace(stage, "if (false) " + stage).replace(arrive, "").replace(
        epilogue, "if (false) " + epilogue)
    return variants


if __name__ == "__main__":
    build_all(sys.argv[1], variants())
