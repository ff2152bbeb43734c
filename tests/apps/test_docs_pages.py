"""Every ```python block of README.md and docs/**/*.md runs as written.

A page's blocks run in order in one namespace, in a fresh Python process per page (so one page's
imports, environment variables and global state never reach another), with a time limit. A block
that imports a peer library (bayesian-torch, blitz, torchbnn, torch-uncertainty, Pyro, TyXe,
transformers, peft) is skipped when that library cannot be imported, and the page's test then
reports a skip after its other blocks passed; CI installs the peers (`make interop`), so there
every block runs. No block is excluded in any other way.

The process gets a one-process ``torch.distributed`` environment (``RANK=0``, ``WORLD_SIZE=1``, a
free ``MASTER_PORT``), as ``torchrun --nproc-per-node 1`` would give it, so the "Many processes"
examples run as they are written, and one torch thread unless ``OMP_NUM_THREADS`` is set (the CI
machine's two cores are shared).
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
from support.doc_blocks import python_blocks
from support.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

#: Import name (first component) -> the peer library it needs, by its import name.
PEERS = {"bayesian_torch": "bayesian_torch", "blitz": "blitz", "torchbnn": "torchbnn",
         "torch_uncertainty": "torch_uncertainty", "pyro": "pyro", "tyxe": "tyxe", "transformers": "transformers",
         "peft": "peft"}
#: mcgraph modules that import a peer when used.
PEER_MODULES = {"mcgraph.interop.pyro": "pyro", "mcgraph.interop.tyxe": "tyxe", "mcgraph.interop.peft": "peft"}

def peers_of(code: str) -> list[str]:
    """The peer libraries a block imports (by its import statements)."""
    needed = set()
    for node in ast.walk(ast.parse(code)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] in PEERS:
                needed.add(PEERS[name.split(".")[0]])
            for module, peer in PEER_MODULES.items():
                if name == module or name.startswith(module + "."):
                    needed.add(peer)
    return sorted(needed)


# Runs in the page's process: argv[1] = JSON [[label, code, [peers]], ...]; prints one JSON line.
RUNNER = r'''
import importlib, importlib.util, json, pathlib, sys, time, traceback, types

def importable(name):
    try:
        importlib.import_module(name)
        return True
    except Exception:
        pass
    if name != "torch_uncertainty" or importlib.util.find_spec("torch_uncertainty") is None:
        return False
    # torch-uncertainty's package __init__ imports lightning and torchvision; its layer and loss
    # modules need only torch: load them under bare parent packages (tests/support/interop_models.py does too).
    for key in [k for k in sys.modules if k.split(".")[0] == "torch_uncertainty"]:
        del sys.modules[key]
    root = pathlib.Path(importlib.util.find_spec("torch_uncertainty").submodule_search_locations[0])
    for sub in ("", ".layers", ".utils", ".losses"):
        package = types.ModuleType("torch_uncertainty" + sub)
        package.__path__ = [str(root / sub.lstrip(".").replace(".", "/"))] if sub else [str(root)]
        sys.modules["torch_uncertainty" + sub] = package
    try:
        importlib.import_module("torch_uncertainty.layers.bayesian")
        return True
    except Exception:
        return False

namespace = {"__name__": "__main__"}
report = {"ran": [], "skipped": [], "failed": None}
for label, code, peers in json.loads(sys.argv[1]):
    missing = [p for p in peers if not importable(p)]
    if missing:
        report["skipped"].append([label, missing])
        continue
    start = time.perf_counter()
    try:
        exec(compile(code, label, "exec"), namespace)
    except BaseException:
        report["failed"] = [label, traceback.format_exc()]
        break
    report["ran"].append([label, round(time.perf_counter() - start, 2)])
sys.stdout.flush()
print("\nDOCS-REPORT " + json.dumps(report))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _label(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def test_pages_have_code():
    assert python_blocks((ROOT / "README.md").read_text()), "README.md has no python block"
    assert sum(len(python_blocks(p.read_text())) for p in PAGES) >= 20


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())], ids=_label)
def test_page_code_blocks_run(page, tmp_path):
    found = python_blocks(page.read_text())
    lines = page.read_text().split("\n")
    starts = [i + 2 for i, line in enumerate(lines) if line.strip().startswith("```python")]
    work = [[f"{_label(page)}:{start} (block {k + 1})", code, peers_of(code)]
            for k, (start, code) in enumerate(zip(starts, found))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               LOCAL_WORLD_SIZE="1", MPLBACKEND="Agg")
    env.setdefault("OMP_NUM_THREADS", "1")
    timeout = 120 + 40 * len(found)
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(work)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    tail = (done.stdout[-3000:] + "\n" + done.stderr[-3000:]).strip()
    marker = [line for line in done.stdout.splitlines() if line.startswith("DOCS-REPORT ")]
    assert marker, f"{_label(page)}: the page's process died (exit {done.returncode}):\n{tail}"
    report = json.loads(marker[-1][len("DOCS-REPORT "):])
    if report["failed"]:
        label, trace = report["failed"]
        pytest.fail(f"{label} failed:\n{trace}\n--- output ---\n{done.stdout[-2000:]}", pytrace=False)
    assert done.returncode == 0, tail
    if report["skipped"]:
        pytest.skip("; ".join(f"{label} needs {', '.join(m)} (`make interop`)" for label, m in report["skipped"])
                    + f"; the other {len(report['ran'])} block(s) ran")
