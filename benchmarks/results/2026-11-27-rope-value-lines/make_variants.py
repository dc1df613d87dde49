"""Builds the kernels that ../2026-11-27-qkv-rope-epilogue/variants.py timed here (with --rule-only):
linear_rope's 12-warp epilogue ("full", cdbeae2) and the same with its FP8 value stores changed:
"v_u32" writes them as keys are written, a u32 a lane at the slot's row (the wrong layout, the same
bytes); "no_v_store" quantizes them but stores nothing; "no_kv_store" stores no keys either. And the
fix that was kept ("lines", b74f944: 32 consecutive dims a store; the timed source also had two
unused helpers that b74f944 removed). Run from the repository root on a machine with nvcc (built
here with nvcc 13.0 for sm_90a; the .so files ran on the H100):
    python benchmarks/results/2026-11-27-rope-value-lines/make_variants.py .devtmp/var
    python benchmarks/results/2026-11-27-qkv-rope-epilogue/variants.py .devtmp/var --rule-only  # on the GPU"""
import importlib.util, sys

# show() and build_all() are the first runs' builder's
_spec = importlib.util.spec_from_file_location(
    "first_variants", "benchmarks/results/2026-11-27-qkv-rope-epilogue/make_variants.py")
first = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(first)

src = first.show("cdbeae2")
vstore = "for (int k = 0; k < 4; ++k) values[k * r.v_dim_stride] = static_cast<uint8_t>(e4m3 >> (8 * k));"
assert src.count(vstore) == 1
never = "if (e4m3 == 0x7f7f7f7fu && scale < 0.f) "  # never true: the quantizing stays, the store goes
variants = {
    "full": src,
    "lines": first.show("b74f944"),
    "v_u32": src.replace(vstore, "reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(r.v_cache) + block * r.block_stride"
                         " + offset * r.k_slot_stride + kv_head * r.k_head_stride)[lane] = e4m3;"),
    "no_v_store": src.replace(vstore, never + "values[0] = 0;"),
}
kstore = "reinterpret_cast<uint32_t*>(keys)[lane] = e4m3;"
assert src.count(kstore) == 1
variants["no_kv_store"] = variants["no_v_store"].replace(kstore, never + kstore)

if __name__ == "__main__":
    first.build_all(sys.argv[1], variants)
