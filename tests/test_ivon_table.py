"""paper_tables.ivon_table: the quick target runs every arm and writes its table (shortened for CI)."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn not installed")


def test_ivon_table_quick_writes_every_arm(tmp_path, monkeypatch):
    from paper_tables import ivon_table

    quick = ivon_table._settings(True)
    monkeypatch.setattr(ivon_table, "_settings", lambda q: quick | {"seeds": 1, "epochs": 3, "predict": 4})
    data = ivon_table.run(tmp_path, quick=True, seed=0)
    runs = data["rows"]["runs"]
    have_ref = importlib.util.find_spec("ivon") is not None
    assert {r["arm"] for r in runs} == set(ivon_table.ARMS)
    scored = {r["arm"] for r in runs if "test" in r}
    assert {"adam", "ivon", "vogn", "bbb"} <= scored and (("ivon_opt" in scored) == have_ref)
    assert all(0 <= r["test"]["accuracy"] <= 1 for r in runs if "test" in r)
    md = (tmp_path / "ivon_table.md").read_text()
    assert "IVON (mcgraph)" in md and "time per step / Adam" in md
    assert json.loads((tmp_path / "ivon_table.json").read_text())["target"] == "ivon_table"
