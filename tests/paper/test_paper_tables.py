"""paper_tables: the generated Table 1 and the d_P formulas, and the whole ``--quick`` run (the CI smoke test, ≈ 3 min)."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys

import pytest

from paper_tables import TARGETS, get_target
from paper_tables.__main__ import main
from paper_tables.theorems import cor3, thm2
from support.paths import ROOT



@pytest.fixture(scope="module")
def table1(tmp_path_factory):
    out = tmp_path_factory.mktemp("pt")
    data = get_target("table1")(out, quick=True, seed=0)
    return out, data


@pytest.fixture(scope="module")
def theorems(tmp_path_factory):
    out = tmp_path_factory.mktemp("pt")
    data = get_target("theorems")(out, quick=True, seed=0)
    return out, data


def _cell(cells, q_paper, p_paper):
    found = [c for c in cells if c["q_paper"] == q_paper and c["p_paper"] == p_paper]
    assert found, f"no {q_paper} × {p_paper} cell"
    return found[0]


def test_registry_of_targets():
    assert set(TARGETS) == {"table1", "theorems", "fig2_left", "fig2_right", "fig1_fig6", "fig7_fig8", "vogn_table",
                            "spike_slab", "sparse_vd_kl", "sparse_vd_table", "random_labels", "bbb_cnn", "ivon_table",
                            "sequence_table", "lora_table"}
    with pytest.raises(ValueError, match="target must be one of"):
        get_target("table9")


def _private_names_of_other_modules(source: str, module: str, modules: set[str]) -> list[str]:
    """``"line: module.name"`` for every private name (leading underscore, not a dunder) that ``source`` (the code
    of ``module``) imports from another module of ``modules``, or reads as an attribute of one it imported."""
    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    tree = ast.parse(source)
    package = module.rpartition(".")[0] or module
    bound: dict[str, str] = {}  # local name -> the module (or package) it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    bound[a.asname or a.name.partition(".")[0]] = a.name if a.asname else a.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(p for p in (package, base) if p)
            for a in node.names:
                if f"{base}.{a.name}" in modules:  # a module: from . import vogn_table as vt
                    bound[a.asname or a.name] = f"{base}.{a.name}"
                elif base in modules and base != module and private(a.name):
                    found.append(f"{node.lineno}: {base}.{a.name}")

    def resolve(expr) -> str | None:
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = resolve(expr.value)
            return None if owner is None else f"{owner}.{expr.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = resolve(node.value)
            if owner in modules and owner != module:
                found.append(f"{node.lineno}: {owner}.{node.attr}")
    return sorted(found, key=lambda f: int(f.partition(":")[0]))


def test_no_table_uses_another_modules_private_names():
    """The tables share helpers through ``paper_tables.common`` or public, documented names of the table that owns
    them: no module of the package imports a private name of another, nor reads one off an imported module."""
    package = ROOT / "paper_tables"
    modules = {"paper_tables"} | {f"paper_tables.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"}
    assert set(TARGETS.values()) <= modules
    check = _private_names_of_other_modules
    # the check sees every form: from-imports (relative, absolute) and attributes of imported modules
    bad = ("from .vogn_table import _with_dropout\n"
           "from paper_tables.vogn_table import network, _data\n"
           "from . import sequence_table, vogn_table as vt\nvt._probs(1)\nsequence_table._fit(2)\n"
           "import paper_tables.vogn_table\npaper_tables.vogn_table._key(3)\n"
           "import paper_tables.ivon_table as it\nit._lstm_key(4)\n")
    assert check(bad, "paper_tables.lora_table", modules) == [
        "1: paper_tables.vogn_table._with_dropout", "2: paper_tables.vogn_table._data",
        "4: paper_tables.vogn_table._probs", "5: paper_tables.sequence_table._fit",
        "7: paper_tables.vogn_table._key", "9: paper_tables.ivon_table._lstm_key"]
    fine = ("from .vogn_table import score\nfrom . import vogn_table as vt\nfrom .common import config_key\n"
            "vt.run_key(1)\nvt.__name__\nmodel._modules.clear()\nimport paper_tables.lora_table as me\nme._key(2)\n")
    assert check(fine, "paper_tables.lora_table", modules) == []
    found = {p.name: check(p.read_text(), "paper_tables" if p.stem == "__init__" else f"paper_tables.{p.stem}", modules)
             for p in sorted(package.glob("*.py"))}
    assert not {name: names for name, names in found.items() if names}, found


def test_table1_files(table1):
    out, data = table1
    for ext in ("md", "png", "json"):
        assert (out / f"table1.{ext}").is_file()
    md = (out / "table1.md").read_text()
    assert "| quantity | paper | ours | scale | why different |" in md
    assert "table1" in (out / "README.md").read_text()
    assert json.loads((out / "table1.json").read_text())["target"] == "table1"


def test_table1_rows_come_from_the_registry(table1):
    import mcgraph as mg

    _, data = table1
    rows = {c["posterior"] for c in data["rows"]}
    assert {cls.__name__ for cls in mg.FAMILIES.registered()} <= rows


def test_table1_normal_normal_collapsed_and_constant(table1):
    _, data = table1
    c = _cell(data["rows"], "Normal", "Normal")
    assert c["status"] == "ok" and c["tier"] == "collapsed" and c["d_P"] == 5
    assert c["paper_groups"]
    assert c["auto_nodes_M1"] == c["auto_nodes_M1000"]
    assert c["auto_bytes_M1"] == c["auto_bytes_M1000"]
    assert c["constant_graph"]


def test_table1_every_measured_cell_is_constant_in_M(table1):
    _, data = table1
    measured = [c for c in data["rows"] if c["status"] == "ok"]
    assert measured
    assert all(c["constant_graph"] for c in measured), [(c["posterior"], c["prior"]) for c in measured
                                                          if not c["constant_graph"]]


def test_table1_non_collapsible_and_infinite_cells_say_why(table1):
    _, data = table1
    laplace = _cell(data["rows"], "Normal", "Laplace")
    assert laplace["tier"] == "fused" and laplace["reasons"]
    expo = _cell(data["rows"], "Normal", "Exponential")  # listed by the paper, but supp N ⊄ supp Exp
    assert expo["status"] == "infinite" and "KL(q‖p) = ∞" in expo["reason"]
    missing = [c for c in data["rows"] if c["status"] == "missing"]
    assert missing and all(c["reason"] for c in missing)


def test_theorems_formulas():
    assert [thm2(k, 2) for k in range(1, 7)] == [2, 3, 4, 5, 6, 7]
    assert [thm2(k, 1) for k in range(1, 7)] == [1] * 6
    assert [cor3(K, 2) for K in range(1, 7)] == [2, 5, 9, 14, 20, 27]
    assert cor3(3, 2) == (3 + 1) * (3 + 2) // 2 - 1  # Example 1


def test_theorems_cor3_matches_for_S2(theorems):
    out, data = theorems
    rows = [r for r in data["rows"] if r["claim"] == "Cor 3" and r["S"] == 2]
    assert [r["k"] for r in rows] == list(range(1, 7))
    assert all(r["d_P"] == math.comb(r["k"] + 2, 2) - 1 for r in rows)
    assert all(r["constant_graph"] for r in rows)
    assert (out / "theorems.png").is_file() and (out / "theorems.md").is_file()


def test_theorems_thm1_and_single_monomial_reported_honestly(theorems):
    _, data = theorems
    s1 = [r for r in data["rows"] if r["S"] == 1 and r["claim"] == "Thm 1"]
    assert len(s1) == 13 and all(r["d_P"] == 1 for r in s1)  # w^k, w^-k, log w
    mono = {r["k"]: r for r in data["rows"] if r["claim"] == "Thm 2" and r["S"] == 2}
    assert all(r["d_P"] == r["formula"] == k + 1 for k, r in mono.items())  # Thm 2: C(k+1, 1)
    line = [c for c in data["comparisons"] if c["quantity"].startswith("Thm 2, S = 2")][0]
    assert "match" in line["ours"] and line["why"] == "—"


def test_cli_single_target(tmp_path):
    assert main(["theorems", "--quick", "--out", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert "theorems" in readme and "Not run into this folder yet" in readme


def test_provenance_notes_are_shown_beside_the_numbers(tmp_path):
    (tmp_path / "theorems.provenance.md").write_text("Run as `python -m paper_tables theorems`, load 0.4.\n")
    assert main(["theorems", "--quick", "--out", str(tmp_path)]) == 0
    page = (tmp_path / "theorems.md").read_text()
    assert "## How the recorded run was made\n\nRun as `python -m paper_tables theorems`, load 0.4." in page
    assert page.index("How the recorded run was made") < page.index("## Environment")


@pytest.mark.integration
def test_quick_all(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "paper_tables", "all", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in TARGETS:
        for ext in ("md", "png", "json"):
            assert (tmp_path / f"{name}.{ext}").is_file(), f"{name}.{ext}"
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["status"] == "ok", f"{name}: {record['status']}"
        assert record["quick"] is True and record["comparisons"], name
    readme = (tmp_path / "README.md").read_text()
    assert all(name in readme for name in TARGETS)
    _assert_quick_spike_slab_outcomes(json.loads((tmp_path / "spike_slab.json").read_text()))
    _assert_quick_sequence_outcomes(json.loads((tmp_path / "sequence_table.json").read_text()))
    _assert_quick_lora_outcomes(json.loads((tmp_path / "lora_table.json").read_text()))


def _assert_quick_lora_outcomes(record: dict) -> None:
    """The quick LoRA table fine-tuned all four arms with both seeds: the pretrained network is at chance on the
    rotated digits, every adapter arm learns the shifted task, and the frozen-trunk last-layer arm does too,
    less well; the pretrained tensors were checked unchanged inside every run."""
    runs = record["rows"]["runs"]
    assert sorted(r["arm"] for r in runs) == sorted(("lora", "mc_dropout", "last_layer", "variational_lora") * 2)
    for r in runs:
        assert r["pretrained_test_accuracy"] <= 0.3, r
        assert r["test"]["accuracy"] >= (0.3 if r["arm"] == "last_layer" else 0.55), (r["arm"], r["test"])
        assert 0.0 <= r["ood"]["noise"] <= 1.0 and 0.0 <= r["ood"]["upright"] <= 1.0


def _assert_quick_sequence_outcomes(record: dict) -> None:
    """The quick sequence table trained all four models on the digits read by rows, with both seeds: each
    learns (chance is 10 %), the predictive entropy tells noise and rotated digits from the test digits, and each
    run trained its whole schedule and kept its learning curve (scored every 2 of 6 epochs)."""
    runs = record["rows"]["runs"]
    assert sorted(r["arm"] for r in runs) == sorted(f"digits:{a}" for a in
                                                    ("lstm", "mc_dropout", "bayes_lstm", "bayes_transformer") * 2)
    for r in runs:
        assert r["complete"] and [p["epoch"] for p in r["curve"]] == [2, 4, 6], r["arm"]
        assert r["curve"][-1]["accuracy"] > r["curve"][0]["accuracy"], (r["arm"], r["curve"])
        assert ("kl_per_example" in r) == (":bayes_" in r["arm"]) and r.get("kl_per_example", 1) > 0, r["arm"]
    for key, a in record["rows"]["aggregate"].items():
        assert a["accuracy"][0] >= 0.8, (key, a["accuracy"])
        assert a["ood_noise"][0] >= 0.6 and a["ood_rotated"][0] >= 0.6, (key, a["ood_noise"], a["ood_rotated"])


def _assert_quick_spike_slab_outcomes(record: dict) -> None:
    """What the quick seed-004 run must show, not only that it ran: the five true inputs of the sparse
    regression survive among at most one spurious one of 995 (≥ 95 % sparsity), and the accuracy of EM's
    one-shot pruning is never below magnitude pruning's at the same sparsity."""
    for run in record["rows"]["regression"]:
        kept = set(run["kept_inputs"])
        assert {1, 2, 3, 4, 5} <= kept and len(kept) <= 6, run["kept_inputs"]
        assert run["sparsity_all_parameters"] >= 0.95 and run["skipped_steps"] == 0, run
    by_setting = {}
    for run in record["rows"]["classifier"]:
        setting = (run["seed"], run.get("spike_decay"), run.get("soft_threshold"))
        by_setting.setdefault(setting, {})[run["method"]] = run
    pairs = [runs for runs in by_setting.values() if {"em", "magnitude"} <= set(runs)]
    assert pairs, sorted(by_setting)
    for runs in pairs:
        assert runs["em"]["accuracy"] >= runs["magnitude"]["accuracy"] - 1e-12, runs


def _run(M: int, seed: int, acc: list, size: list) -> dict:
    from paper_tables.fig7_fig8 import THRESHOLDS

    pad = len(THRESHOLDS) - len(acc)
    return {"M": M, "seed": seed, "accuracy": acc[0], "train_seconds": 1.0,
            "conf_accuracy": acc + [None] * pad, "conf_size": size + [0.0] * pad}


def test_fig7_fig8_aggregate_and_delta():
    """Mean ± sample std over seeds per threshold; Δ(100 − 1) in points with its standard error;
    empty sets (None) are left out of the mean and counted."""
    from paper_tables.fig7_fig8 import _delta, aggregate

    runs = [_run(1, 0, [0.90, 0.95], [1.0, 0.5]), _run(1, 1, [0.92, None], [1.0, 0.0]),
            _run(100, 0, [0.94, 0.97], [1.0, 0.6]), _run(100, 1, [0.96, 0.99], [1.0, 0.4])]
    agg = aggregate(runs, (1, 100))
    assert agg[1]["acc_mean"][0] == pytest.approx(0.91) and agg[1]["acc_n"][:2] == [2, 1]
    assert agg[1]["acc_mean"][1] == pytest.approx(0.95)
    assert agg[100]["acc_std"][0] == pytest.approx(math.sqrt(2) * 0.01)
    assert agg[100]["size_mean"][1] == pytest.approx(0.5)
    d, se = _delta(agg, 0)
    assert d == pytest.approx(4.0)
    assert se == pytest.approx(100 * math.sqrt(2 * 0.0002 / 2))


def test_sparse_vd_kl_quick_agrees_with_quadrature(tmp_path):
    data = get_target("sparse_vd_kl")(tmp_path, quick=True, seed=0)
    rows = data["rows"]["grid"]
    assert len(rows) == 33 and rows[0]["log_alpha"] == -8.0 and rows[-1]["log_alpha"] == 8.0
    # mcgraph's estimate and the quadrature agree within 5 standard errors at every point
    assert all(abs(r["mcgraph_minus_quadrature"]) <= 5 * r["se"] + 1e-9 for r in rows)
    worst = max(rows, key=lambda r: abs(r["approx_minus_quadrature"]))
    assert 0.009 < abs(worst["approx_minus_quadrature"]) < 0.01 and worst["log_alpha"] == -3.5
    g = data["rows"]["graph_size"]
    assert g["M1"] == next(v for k, v in g.items() if k != "M1")


def test_sparse_vd_ablations_change_one_aspect_each_and_render(tmp_path):
    """Each ablation is the adopted recipe with its own overrides only (LeNet-300-100, seed 0, its own cache
    files); an unknown one is refused by name; recorded rows render with their curve's compression."""
    from paper_tables import sparse_vd_table as t

    adopted = t._settings(False)
    for ablation, (_, overrides) in t.ABLATIONS.items():
        s = t.ablation_settings(ablation)
        for key in set(s) | set(adopted):
            if key in overrides:
                assert s[key] == overrides[key], (ablation, key)
            elif key not in ("nets", "arms", "seeds", "tag"):
                assert s.get(key) == adopted.get(key), (ablation, key)
        assert (s["nets"], s["arms"], s["tag"]) == (["lenet300_100"], ["sparse_vd"], f"-ablation-{ablation}")
    with pytest.raises(ValueError, match="ablation must be one of"):
        t.ablation_settings("Z")
    run = {"error": 0.0191, "compression": 107.9, "per_layer_sparsity": [0.992, 0.985, 0.8], "epochs_done": 200,
           "epochs": 200, "complete": True, "key": "k",
           "curve": [{"epoch": e, "error": 0.02, "compression": float(e)} for e in (50, 100, 150, 200)]}
    t.record_ablation(tmp_path, t.ablation_row("F", run, "a test"))
    t.record_ablation(tmp_path, t.ablation_row("B", dict(run, compression=40.0), "a test"))
    rows = t.load_ablations(tmp_path)
    assert [r["id"] for r in rows] == ["B", "F"] and rows[0]["relative_to"] == "F"
    table = t.ablation_table(rows)
    assert "| F |" in table and "50.0 / 100.0 / 150.0" in table and "| 40.0 |" in table
