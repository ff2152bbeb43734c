"""``make gpu-check`` must not rot on machines without a GPU: its smoke mode runs every section on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("triton", reason="triton is not installed")


def test_gpu_check_smoke_runs_every_section(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--smoke", "--out-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-smoke.json").read_text())
    sections = {s["name"]: s for s in result["sections"]}
    assert set(sections) == {"kernel_tests", "kernels", "resnet18_step", "peer_mlp", "ivon_speed", "optim_samples"}
    assert all(s["status"] == "ok" for s in sections.values()), {k: s["status"] for k, s in sections.items()}
    assert sections["kernel_tests"]["counts"].get("passed", 0) > 0
    assert "failed" not in sections["kernel_tests"]["counts"]
    kernels = {r["kernel"] for r in sections["kernels"]["rows"]}
    assert {"noise_stats", "torch:noise_stats", "fused_log_prob", "torch:fused_log_prob"} <= kernels
    assert all("speedup_vs_torch" in r for r in sections["kernels"]["rows"] if r["kernel"] == "noise_stats")
    methods = {r["method"] for r in sections["resnet18_step"]["rows"]}
    assert {"direct", "grad-accum", "mcgraph"} <= methods
    providers = {r["provider"] for r in sections["peer_mlp"]["rows"] if r["status"] == "ok"}
    assert "mcgraph" in providers
    assert {r["model"] for r in sections["ivon_speed"]["rows"]} == {"tiny"}
    assert {"adam", "ivon"} <= set(sections["ivon_speed"]["rows"][0]["providers"])
    assert {r["point"] for r in sections["optim_samples"]["rows"]} == {
        "ivon:sequential:1", "ivon:batched:4", "vogn:sequential:1", "vogn:batched:4"}
    md = (tmp_path / "gpu-smoke.md").read_text()
    assert "| kernels | ok |" in md
    assert "## IVON's step against Adam's" in md and "## K samples per step" in md
    assert not list(tmp_path.glob("*.jsonl"))  # the benches' rows live in the report, not beside it


def test_gpu_check_without_cuda_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and "--smoke" in done.stderr
