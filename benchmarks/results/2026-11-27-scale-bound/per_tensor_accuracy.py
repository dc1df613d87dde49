"""FP8 KV cache accuracy: per-vector scales (as committed) against one per-tensor scale.

Run against a worktree carrying per_tensor_accuracy.diff (its kv_cache.quantize reads
MINIVLLM_ACC_VARIANT), imported as `minivllm` through PYTHONPATH:
    cd /work/main && git worktree add -f --detach .devtmp/acc HEAD
    git -C .devtmp/acc apply benchmarks/results/2026-11-27-scale-bound/per_tensor_accuracy.diff
    mkdir -p /tmp/acc && ln -sfn /work/main/.devtmp/acc /tmp/acc/minivllm
    PYTHONPATH=/tmp/acc python benchmarks/results/2026-11-27-scale-bound/per_tensor_accuracy.py

Variants (the fp8 run's quantize; the auto run is shared):
  vector      one bfloat16 scale per (token, KV head) = amax / 448 rounded up (as committed)
  vector*1.3  the same with amax / 448 * 1.3 (amax maps to ~345): the same format on a shifted
              rounding grid, so its difference from `vector` gauges the noise of one text
  one         every scale 1.0: e4m3 of the raw value clamped to +-448 (vLLM, k_scale = v_scale = 1.0)
  const 0.7   every scale 0.7 (bfloat16 0.69922): `one` on a shifted grid, its noise gauge
  first       one scale per (layer, K/V) = amax of that layer's first write_kv tensor (all tokens,
              all heads) / 448 rounded up to bfloat16, fixed for the rest of the run (later values
              past 448 * scale clamp), as vLLM's calculate_kv_scales fixes its scale after the
              first pass
  call        one scale per write_kv call = amax of the call's whole tensor / 448 (not vLLM: refit
              every step)
Metrics as tests/e2e/test_fp8_kv_cache.py: teacher-forced top-1 agreement of fp8 against auto,
and |log-prob drift| of the text's actual next token (mean, max), chunks of 64 tokens.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

import minivllm

ROOT = os.path.dirname(os.path.realpath(minivllm.__file__))
assert ".devtmp/acc" in ROOT, ROOT
sys.path.insert(0, ROOT)  # tests.* of the worktree

from tests.e2e.test_fp8_kv_cache import TEXT, teacher_forced  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

from minivllm.frontend.model_download import download_default_model  # noqa: E402

VARIANTS = {
    "vector": {"MINIVLLM_ACC_VARIANT": "vector"},
    "vector*1.3": {"MINIVLLM_ACC_VARIANT": "vector", "MINIVLLM_ACC_MULT": "1.3"},
    "one": {"MINIVLLM_ACC_VARIANT": "one"},
    "const 0.7": {"MINIVLLM_ACC_VARIANT": "const", "MINIVLLM_ACC_CONST": "0.7"},
    "first": {"MINIVLLM_ACC_VARIANT": "first"},
    "call": {"MINIVLLM_ACC_VARIANT": "call"},
}
ACC_ENV = ("MINIVLLM_ACC_VARIANT", "MINIVLLM_ACC_MULT", "MINIVLLM_ACC_CONST", "MINIVLLM_ACC_KVSTATS")


def set_variant(variant: str) -> None:
    for key in ACC_ENV:
        os.environ.pop(key, None)
    os.environ.update(VARIANTS[variant])


def readme_prompts(count: int = 8, chars: int = 3000) -> list[str]:
    """Supplementary text for SmolLM2: the worktree README's prose, in `count` pieces."""
    text = open(os.path.join(ROOT, "README.md")).read()
    return [text[i * chars:(i + 1) * chars] for i in range(count)]


def metrics(full: list, fp8: list) -> tuple[float, float, float]:
    agree, drift = [], []
    for a, b in zip(full, fp8, strict=True):
        assert a.prompt_token_ids == b.prompt_token_ids
        for i in range(1, len(a.prompt_token_ids)):
            rows_a, rows_b = a.prompt_logprobs[i], b.prompt_logprobs[i]
            top_a = max(rows_a.items(), key=lambda kv: kv[1].logprob)[0]
            top_b = max(rows_b.items(), key=lambda kv: kv[1].logprob)[0]
            agree.append(top_a == top_b)
            actual = a.prompt_token_ids[i]
            drift.append(abs(rows_a[actual].logprob - rows_b[actual].logprob))
    return float(np.mean(agree)), float(np.mean(drift)), float(np.max(drift))


def load_writes(stats_dir: str) -> list[list[dict]]:
    """The auto run's write_kv calls, per layer (in layer order), each in call order."""
    by_ptr: dict[int, list[dict]] = {}
    for f in sorted(glob.glob(os.path.join(stats_dir, "*.pt"))):
        d = torch.load(f)
        by_ptr.setdefault(d["ptr"], []).append(d)
    return [by_ptr[ptr] for ptr in sorted(by_ptr)]


def magnitudes(layers: list[list[dict]], name: str) -> None:
    """Per layer: max and median of |k|, |v| over every token written in the auto run, the range of
    per-vector amax (what per-vector scales adapt to), the first write's amax against the whole
    run's (what `first` fixes), and the share of elements under e4m3's smallest normal (2^-6: there
    a scale of 1.0 keeps fewer than 4 significant bits)."""
    print(f"\n{name}: |K|, |V| in the auto run's cache writes ({sum(map(len, layers))} write_kv calls, "
          f"{len(layers)} layers)")
    print("layer  |k| max  |k| median  k vec-amax min/median  k first/all   |v| max  |v| median  "
          "v vec-amax min/median  v first/all   k<2^-6 %  v<2^-6 %")
    for layer, writes in enumerate(layers):
        k = torch.cat([w["k"] for w in writes]).abs()
        v = torch.cat([w["v"] for w in writes]).abs()
        kv_amax, vv_amax = k.amax(-1), v.amax(-1)
        k_first = float(writes[0]["k"].abs().max() / k.max())
        v_first = float(writes[0]["v"].abs().max() / v.max())
        k_sub = float((k < 2 ** -6).float().mean()) * 100
        v_sub = float((v < 2 ** -6).float().mean()) * 100
        print(f"{layer:5d}  {k.max():7.3f}  {k.median():10.4f}  {kv_amax.min():8.3f} / {kv_amax.median():7.3f}"
              f"  {k_first:11.2f}   {v.max():7.3f}  {v.median():10.4f}  {vv_amax.min():8.3f} / {vv_amax.median():7.3f}"
              f"  {v_first:11.2f}   {k_sub:8.1f}  {v_sub:8.1f}")


def quantization_errors(layers: list[list[dict]], name: str) -> None:
    """Each variant's quantize replayed in this process over the auto run's writes, in order:
    relative error ||dequant - x|| / ||x|| of K and V per layer (deterministic, unlike the
    end-to-end numbers)."""
    from minivllm.worker.attention import kv_cache

    errors: dict[str, list[tuple[float, float]]] = {}
    for variant in VARIANTS:
        set_variant(variant)
        kv_cache._ACC_FIRST_SCALES.clear()
        rows = []
        for layer, writes in enumerate(layers):
            rel = []
            for kv in ("k", "v"):
                err = ref = 0.0
                for w in writes:
                    x = w[kv]
                    data, scale = kv_cache.quantize(x, cache_key=(layer, kv))
                    back = kv_cache.dequantize(data, scale.to(torch.bfloat16).float(), torch.float32)
                    err += float(((back - x) ** 2).sum())
                    ref += float((x ** 2).sum())
                rel.append((err / ref) ** 0.5)
            rows.append(tuple(rel))
        errors[variant] = rows
    set_variant("vector")
    print(f"\n{name}: relative quantization error ||dq(q(x)) - x|| / ||x|| of the cached K / V, per layer")
    print("layer  " + "  ".join(f"{v:>17s}" for v in VARIANTS))
    shown = range(len(layers)) if len(layers) <= 4 else sorted({0, 1, 2, len(layers) // 2, len(layers) - 1})
    for layer in shown:
        print(f"{layer:5d}  " + "  ".join(f"{errors[v][layer][0]:.4f} / {errors[v][layer][1]:.4f}" for v in VARIANTS))
    print(" mean  " + "  ".join(f"{np.mean([r[0] for r in errors[v]]):.4f} / {np.mean([r[1] for r in errors[v]]):.4f}"
                                for v in VARIANTS))


def largest_element_breakdown(layers: list[list[dict]], name: str) -> None:
    """Where the error differs: each vector's largest element against its other elements (all
    layers together), for vector, vector*1.3 and one."""
    from minivllm.worker.attention import kv_cache

    print(f"\n{name}: relative error of each (token, head) vector's largest |element| vs the rest, all layers")
    for kv in ("k", "v"):
        x = torch.cat([w[kv].reshape(-1, w[kv].shape[-1]) for writes in layers for w in writes])
        top = x.abs().argmax(-1, keepdim=True)
        rest = torch.ones_like(x, dtype=torch.bool).scatter_(-1, top, False)
        share = float((x.gather(-1, top) ** 2).sum() / (x ** 2).sum())
        line = f"  {kv.upper()} (largest element holds {share:.0%} of ||x||^2):"
        for variant in ("vector", "vector*1.3", "one"):
            set_variant(variant)
            err = kv_cache.dequantize(*kv_cache.quantize(x), torch.float32) - x
            line += (f"  {variant} all {float(err.norm() / x.norm()):.4f}, largest "
                     f"{float(err.gather(-1, top).norm() / x.gather(-1, top).norm()):.4f}, rest "
                     f"{float(err[rest].norm() / x[rest].norm()):.4f};")
        print(line)
    set_variant("vector")


def main() -> None:
    print(f"minivllm from {ROOT}; torch {torch.__version__}; {os.cpu_count()} CPUs")
    work = tempfile.mkdtemp(prefix="per_tensor_acc_")  # tiny models and the auto runs' K/V (removed at the end)
    rng = np.random.default_rng(0)
    tiny_prompts = [{"prompt_token_ids": rng.integers(3, 200, size=n).tolist()} for n in (150, 90, 40)]
    models = [
        ("SmolLM2-135M-Instruct", str(download_default_model()), [TEXT]),
        ("tiny llama", build_tiny_model(os.path.join(work, "llama"), arch="llama", seed=0), tiny_prompts),
        ("tiny qwen3", build_tiny_model(os.path.join(work, "qwen3"), arch="qwen3", seed=0), tiny_prompts),
    ]
    table = []
    for name, path, prompts in models + [("SmolLM2 README (suppl.)", models[0][1], readme_prompts())]:
        stats_dir = os.path.join(work, name.split(" (")[0].replace(" ", "_") + "_kv")
        os.makedirs(stats_dir)
        set_variant("vector")
        os.environ["MINIVLLM_ACC_KVSTATS"] = stats_dir
        t = time.time()
        full = teacher_forced(path, "auto", prompts)
        set_variant("vector")
        print(f"{name}: auto run {time.time() - t:.0f} s, {len(prompts)} prompts, "
              f"{sum(len(o.prompt_token_ids) for o in full)} tokens")
        layers = load_writes(stats_dir)
        magnitudes(layers, name)
        quantization_errors(layers, name)
        largest_element_breakdown(layers, name)
        print()
        for variant in VARIANTS:
            set_variant(variant)
            t = time.time()
            agreement, mean_drift, max_drift = metrics(full, teacher_forced(path, "fp8", prompts))
            table.append((name, variant, agreement, mean_drift, max_drift))
            print(f"{name:24s} {variant:10s} top-1 agreement {agreement:.3f}  drift mean {mean_drift:.4f}  "
                  f"max {max_drift:.3f}   ({time.time() - t:.0f} s)", flush=True)
        set_variant("vector")
        print()
    print("\nmodel                    variant     agreement  mean drift  max drift")
    for name, variant, agreement, mean_drift, max_drift in table:
        print(f"{name:24s} {variant:10s}  {agreement:9.3f}  {mean_drift:10.4f}  {max_drift:9.3f}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
