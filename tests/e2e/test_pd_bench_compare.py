"""`minivllm bench compare` end to end on CPU with a tiny model and a handful of requests: every
setup's instances really start, serve the workload and stop; the report and its plots are written."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.server_procs import MINIVLLM

SERVE_ARGS = "--device cpu --num-gpu-blocks 128 --max-model-len 256"


def run_compare(tiny_llama: str, out_dir: str, setups: str, *extra: str) -> dict:
    result = subprocess.run(
        [*MINIVLLM, "bench", "compare", "--model", tiny_llama, "--setups", setups, "--serve-args", SERVE_ARGS,
         "--num-prompts", "4", "--input-len", "40:90", "--output-len", "6", "--request-rate", "inf,20",
         "--goodput", "ttft:60000", "--startup-timeout", "120", "--out-dir", out_dir, *extra],
        capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(os.path.join(out_dir, "results.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("setups", ["v1,1p1d", pytest.param("v0,v1,v1x2,1p1d", marks=pytest.mark.slow)])
def test_bench_compare_writes_a_report_for_every_setup(tiny_llama: str, tmp_path, setups: str) -> None:
    """CI runs two setups (each start costs ~10 s on a 2-core box), the second through --resume,
    which keeps the first's measurements; -m slow runs four in one go."""
    out_dir = str(tmp_path / "compare")
    if setups == "v1,1p1d":
        first = run_compare(tiny_llama, out_dir, "v1")
        report = run_compare(tiny_llama, out_dir, setups, "--resume")
        assert report["runs"]["v1"] == first["runs"]["v1"]  # kept, not measured again
    else:
        report = run_compare(tiny_llama, out_dir, setups)
    assert list(report["runs"]) == setups.split(",")
    for setup, results in report["runs"].items():
        assert [r["request_rate"] for r in results] == ["inf", 20.0]
        for r in results:
            assert r["completed"] == 4 and r["total_output_tokens"] == 4 * 6, (setup, r)
            assert r["goodput"] is not None
        assert len(report["raw"][setup][0]["ttft_s"]) == 4
    assert report["kv_transfer"]["requests"] >= 8 and report["kv_transfer"]["gb_per_s"] > 0
    markdown = open(os.path.join(out_dir, "report.md")).read()
    for name in ("ttft_cdf.png", "itl_cdf.png", "vs_rate.png"):
        assert os.path.getsize(os.path.join(out_dir, name)) > 1000
        assert name in markdown
    assert "| 1p1d | 20.0 | 4/4 |" in markdown and "KV transfer" in markdown


def test_each_rate_gets_prompts_of_its_own() -> None:
    """A rate that replayed the previous rate's prompts would be served from the prefix cache."""
    from minivllm.frontend.bench_compare import rate_workloads

    workloads = rate_workloads(8, "40:90", "6", 1000, seed=0, num_rates=3)
    first_blocks = [{tuple(p[:16]) for p in w.prompts} for w in workloads]
    assert all(len(blocks) == 8 for blocks in first_blocks)
    assert not (first_blocks[0] & first_blocks[1]) and not (first_blocks[1] & first_blocks[2])
    assert rate_workloads(8, "40:90", "6", 1000, seed=0, num_rates=3)[2].prompts == workloads[2].prompts
