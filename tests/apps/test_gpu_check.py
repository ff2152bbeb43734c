"""``make gpu-check`` must not rot on machines without a GPU: its smoke mode runs every section on CPU, and
``--quick`` plans every section smaller, within 4 minutes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from support.paths import ROOT

pytestmark = pytest.mark.integration

SECTIONS = {"kernel_tests", "families", "kernels", "resnet18_step", "peer_mlp", "sequence", "lora", "predict_overhead",
            "ivon_speed", "optim_samples"}

pytest.importorskip("triton", reason="triton is not installed")


def test_gpu_check_smoke_runs_every_section(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--smoke", "--out-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-smoke.json").read_text())
    sections = {s["name"]: s for s in result["sections"]}
    assert set(sections) == SECTIONS
    peft = all(importlib.util.find_spec(m) for m in ("transformers", "peft"))
    expected = {k: "ok" for k in sections}
    if not peft:  # the LoRA section needs transformers and peft
        expected["lora"] = sections["lora"]["status"]
    assert {k: s["status"] for k, s in sections.items()} == expected
    assert peft or sections["lora"]["status"].startswith("skipped")
    assert sections["kernel_tests"]["counts"].get("passed", 0) > 0
    assert "failed" not in sections["kernel_tests"]["counts"]
    kernels = {r["kernel"] for r in sections["kernels"]["rows"]}
    assert {"noise_stats", "torch:noise_stats", "fused_log_prob", "torch:fused_log_prob"} <= kernels
    assert all("speedup_vs_torch" in r for r in sections["kernels"]["rows"] if r["kernel"] == "noise_stats")
    methods = {r["method"] for r in sections["resnet18_step"]["rows"]}
    assert {"direct", "grad-accum", "mcgraph"} <= methods
    peer = [r for r in sections["peer_mlp"]["rows"] if r["status"] == "ok"]
    assert {"mcgraph", "mcgraph (forced tiers)"} <= {r["provider"] for r in peer}
    assert all(r["randn_floor_s"] > 0 and r["of_floor"] > 0 and r["weights"] > 0 for r in peer)
    assert "defaults" in next(r["settings"] for r in peer if r["provider"] == "mcgraph")
    # every family of the smoke subset × every check, all passed on the CPU
    families = sections["families"]
    assert families["counts"].get("passed", 0) >= 30 and "failed" not in families["counts"]
    matrix = {(r["family"], r["check"]): r["outcome"] for r in families["rows"] if r["matrix"]}
    assert {f for f, _ in matrix} >= {"linear", "lstm-h0", "gru-2layer", "mc-dropout", "vogn-posterior"}
    assert {c for _, c in matrix} == {"forward", "elbo-M1", "elbo-M16", "elbo-M16-chunks", "predict", "kl"}
    assert set(matrix.values()) == {"passed"}
    seq = [r for r in sections["sequence"]["rows"] if "time_s" in r]
    assert {r["provider"] for r in seq} >= {"mcgraph"} and {r["M"] for r in seq} == {1, 2}
    assert all(r["randn_floor_s"] > 0 and r["weights"] > 0 and r["of_floor"] > 0 for r in seq)
    if peft:
        lora = {(r["mode"], r["provider"], r["M"]) for r in sections["lora"]["rows"] if "time_s" in r}
        assert {("train", "mcgraph", 2), ("train", "lora-loop", 2), ("train", "lora", 1), ("predict", "mcgraph", 2),
                ("predict", "lora-loop", 2)} <= lora
        assert all(r["randn_floor_s"] > 0 for r in sections["lora"]["rows"])
    assert {r["provider"] for r in sections["predict_overhead"]["rows"]} >= {"loop", "predict"}
    assert {r["model"] for r in sections["ivon_speed"]["rows"]} == {"tiny"}
    assert {"adam", "ivon"} <= set(sections["ivon_speed"]["rows"][0]["providers"])
    assert {r["point"] for r in sections["optim_samples"]["rows"]} == {
        "ivon:sequential:1", "ivon:batched:4", "vogn:sequential:1", "vogn:batched:4"}
    md = (tmp_path / "gpu-smoke.md").read_text()
    assert "| kernels | ok |" in md and "| families | ok |" in md
    assert "| family | forward | elbo-M1 | elbo-M16 | elbo-M16-chunks | predict | kl |" in md
    assert "| lstm-h0 | ok | ok | ok | ok | ok | ok |" in md
    assert "## Bayesian LSTM classifier" in md and "## mg.nn.predict against M plain forwards" in md
    assert "randn floor ms" in md and "| mcgraph (forced tiers) | 1 | ok |" in md
    assert not peft or "## Bayesian LoRA on GPT-2" in md
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


def test_quick_mode_plans_every_section_smaller_within_four_minutes(monkeypatch, tmp_path):
    """``--quick`` on a GPU: each section's command asks for less than the full run, and the limits add up to
    4 minutes, so the whole check ends within them (the sections are not run here: their commands are kept)."""
    from bench import gpu_check

    assert set(gpu_check.LIMITS) == set(gpu_check.QUICK_LIMITS) == SECTIONS == set(gpu_check.SECTIONS)
    assert sum(gpu_check.QUICK_LIMITS.values()) <= 240
    planned = {}

    def fake(name, cmd, timeout, smoke, extra_env=None):
        planned[name] = (cmd, timeout, extra_env or {})
        return {"name": name, "command": " ".join(cmd), "status": "ok", "seconds": 0.0, "output_tail": ""}

    monkeypatch.setattr(gpu_check, "run_section", fake)
    monkeypatch.setattr(gpu_check, "_installed", lambda module: True)
    args = gpu_check.argparse.Namespace(smoke=False, quick=True, date="d", tag="d-quick", max_m=True,
                                        kernel_sizes=[10**6, 10**7, 10**8], kernel_samples=[1, 100, 1000],
                                        kernel_max_seconds=0.05,
                                        **{f"timeout_{o}": None for o in gpu_check.TIMEOUT_OPTIONS})
    for name, run in (("kernel_tests", lambda: gpu_check.kernel_tests(args)),
                      ("families", lambda: gpu_check.families(args, tmp_path)),
                      ("kernels", lambda: gpu_check.kernels_bench(args, tmp_path)),
                      ("resnet18_step", lambda: gpu_check.resnet18_step(args, tmp_path)),
                      ("peer_mlp", lambda: gpu_check.peer_mlp(args, tmp_path)),
                      ("sequence", lambda: gpu_check.sequence(args, tmp_path)),
                      ("lora", lambda: gpu_check.lora(args, tmp_path)),
                      ("predict_overhead", lambda: gpu_check.predict_overhead(args, tmp_path)),
                      ("ivon_speed", lambda: gpu_check.ivon_speed(args, tmp_path)),
                      ("optim_samples", lambda: gpu_check.optim_samples(args, tmp_path))):
        run()
    assert set(planned) == SECTIONS
    assert sum(timeout for _, timeout, _ in planned.values()) <= 240
    cmd = {name: " ".join(c) for name, (c, _, _) in planned.items()}
    assert planned["families"][2] == {"MCGRAPH_TEST_DEVICE": "cuda"} and " -k " not in cmd["families"]
    assert planned["kernel_tests"][2] == {"MCGRAPH_KERNEL_DEVICE": "cuda"} and " -k " in cmd["kernel_tests"]
    assert "--sizes 1000000 10000000 --samples 1 100" in cmd["kernels"]
    assert "--samples 1,10" in cmd["resnet18_step"] and "--no-max-m" in cmd["resnet18_step"]
    assert "--samples 1 16 --reps 1" in cmd["peer_mlp"]
    assert "--device cuda --samples 1 16 " in cmd["sequence"] and "--randn-floor" in cmd["sequence"]
    assert "--providers mcgraph blitz bayesian-torch" in cmd["sequence"] and "--chunk-size 0" in cmd["sequence"]
    assert "--device cuda" in cmd["lora"] and "--samples 1 8 " in cmd["lora"] and "--seq 128" in cmd["lora"]
    assert "lora-loop" in cmd["lora"] and "--modes train predict" in cmd["lora"]
    assert "--device cuda --samples 32 --reps 3" in cmd["predict_overhead"]
    assert "--reps 10" in cmd["ivon_speed"] and "--reps 3" in cmd["optim_samples"]
