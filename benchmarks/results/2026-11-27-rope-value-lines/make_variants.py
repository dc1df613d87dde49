"""Builds the kernels variants.py times: linear_rope's 12-warp epilogue ("full", cdbeae2), the same
with its FP8 value stores changed ("v_u32": written as keys are, a u32 a lane at the slot's row,
the wrong layout but the same bytes; "no_v_store": quantized but not stored; "no_kv_store": nor
the keys), and the fix that was kept ("lines", b74f944: 32 consecutive dims a store; the timed
source also had two unused helpers that b74f944 removed). Run from the repository root on a machine
with nvcc (built here with nvcc 13.0 for sm_90a; the .so files ran on the H100):
    python benchmarks/results/2026-11-27-rope-value-lines/make_variants.py .devtmp/var"""
import os, shutil, subprocess, sys
from concurrent.futures import ThreadPoolExecutor

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
shutil.copy("worker/hopper_ptx.cuh", out)
show = lambda rev: subprocess.run(["git", "show", f"{rev}:worker/hopper_gemm.cu"], capture_output=True, text=True,
                                  check=True).stdout
src = show("cdbeae2")
vstore = "for (int k = 0; k < 4; ++k) values[k * r.v_dim_stride] = static_cast<uint8_t>(e4m3 >> (8 * k));"
assert src.count(vstore) == 1
never = "if (e4m3 == 0x7f7f7f7fu && scale < 0.f) "  # never true: the quantizing stays, the store goes
variants = {
    "full": src,
    "lines": show("b74f944"),
    "v_u32": src.replace(vstore, "reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(r.v_cache) + block * r.block_stride"
                         " + offset * r.k_slot_stride + kv_head * r.k_head_stride)[lane] = e4m3;"),
    "no_v_store": src.replace(vstore, never + "values[0] = 0;"),
}
kstore = "reinterpret_cast<uint32_t*>(keys)[lane] = e4m3;"
assert src.count(kstore) == 1
variants["no_kv_store"] = variants["no_v_store"].replace(kstore, never + kstore)


def build(name: str) -> None:
    path = os.path.join(out, f"{name}.cu")
    with open(path, "w") as f:
        f.write(variants[name])
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler",
                    "-fPIC", "-o", os.path.join(out, f"{name}.so"), path], check=True, capture_output=True)


with ThreadPoolExecutor(2) as pool:
    list(pool.map(build, variants))
