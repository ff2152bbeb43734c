"""The package's shape: no import cycle among mcgraph's modules, and imports only run down the floors
(engine ← nn, optim, interop ← apps). Every import is read from the source, lazy ones inside functions too."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest
from support.paths import ROOT

PACKAGES = {"mcgraph": ROOT / "mcgraph", "mcgraph.kernels": ROOT / "kernels"}
#: ``mcgraph/kernels`` is a link to the top-level ``kernels/`` folder (its modules are read once, from there).
LINKED = {ROOT / "mcgraph" / "kernels"}

#: What each part may import from mcgraph (besides itself). ``mcgraph`` is the package's face. The kernels
#: sit below the engine (the engine reaches them as ``mcgraph.kernels``; they import none of it).
FLOORS = {
    "mcgraph.registry": set(),
    "mcgraph.distributions": set(),
    "mcgraph.metrics": set(),
    "mcgraph.kernels": {"mcgraph.distributions", "mcgraph.registry"},
    "mcgraph.models": {"mcgraph.registry"},
    "mcgraph.engine": {"mcgraph.kernels", "mcgraph.distributions", "mcgraph.registry"},
    "mcgraph.nn": {"mcgraph.engine", "mcgraph.kernels", "mcgraph.distributions", "mcgraph.metrics", "mcgraph.models",
                   "mcgraph.registry"},
    "mcgraph.optim": {"mcgraph.engine", "mcgraph.distributions", "mcgraph.nn", "mcgraph.metrics", "mcgraph.registry"},
    "mcgraph.interop": {"mcgraph.engine", "mcgraph.distributions", "mcgraph.nn", "mcgraph.registry"},
    "mcgraph.apps": {"mcgraph", "mcgraph.engine", "mcgraph.kernels", "mcgraph.distributions", "mcgraph.nn",
                     "mcgraph.optim", "mcgraph.interop", "mcgraph.metrics", "mcgraph.models", "mcgraph.registry"},
}

#: The engine's own floors, from the ground up: a module imports only from its floor and those below.
ENGINE_FLOORS = [
    {"checks", "shapes", "options", "methods", "native", "closed_form", "graph_size", "budget"},
    {"noise"},
    {"plan"},
    {"distributed"},
    {"estimators"},
    {"stderr"},
    {"api"},
]


def _modules() -> dict[str, Path]:
    found = {}
    for name, base in PACKAGES.items():
        for path in base.rglob("*.py"):
            if any(link in path.parents for link in LINKED):
                continue
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([name, *parts])] = path
    return found


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """mcgraph modules that ``module`` imports (the longest known prefix of each imported name)."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _part(module: str) -> str:
    for part in sorted(FLOORS, key=len, reverse=True):
        if module == part or module.startswith(part + "."):
            return part
    return module


def test_no_import_cycle():
    graph = _graph()
    # package faces (__init__) re-export their children: an edge into a package's own face is not a cycle
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state, stack, cycles = defaultdict(int), [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state[t] == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif state[t] == 0:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if state[m] == 0:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_run_down_the_floors():
    bad = []
    for module, targets in _graph().items():
        part = _part(module)
        if part not in FLOORS:
            continue
        for t in targets:
            tp = _part(t)
            if tp != part and tp not in FLOORS[part]:
                bad.append(f"{module} imports {t}")
    assert not bad, "\n".join(sorted(bad))


def test_module_names_are_unique():
    by_name = defaultdict(list)
    for module in _modules():
        leaf = module.rpartition(".")[2]
        if leaf not in ("__init__", "__main__") and module.rpartition(".")[0] != "":
            by_name[leaf].append(module)
    dup = {k: v for k, v in by_name.items() if len(v) > 1 and k not in {m.rpartition(".")[2] for m in PACKAGES}}
    assert not dup, dup


@pytest.mark.parametrize("path", ["mcgraph.expectation", "mcgraph.kl_divergence", "mcgraph.nn.bayesify",
                                  "mcgraph.nn.kl", "mcgraph.nn.elbo", "mcgraph.optim.VOGN", "mcgraph.interop.kl"])
def test_public_paths_resolve(path):
    import mcgraph

    obj = mcgraph
    for part in path.split(".")[1:]:
        obj = getattr(obj, part)
    assert callable(obj)


def test_every_package_ships_in_the_wheel():
    """pyproject's package list names every folder with an ``__init__.py`` (a missing one installs
    editable but not from the wheel), ``mcgraph.kernels`` (a namespace package: the linked ``kernels/``
    folder) and every ``csrc`` folder, whose C++ sources, compiled at first use, are its package data."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {".".join(["mcgraph", *p.parent.relative_to(ROOT / "mcgraph").parts]).rstrip(".")
               for p in (ROOT / "mcgraph").rglob("__init__.py")}
    sources = {".".join(["mcgraph", *p.parent.relative_to(ROOT / "mcgraph").parts])
               for p in (ROOT / "mcgraph").rglob("csrc/*.cpp")}
    assert {"mcgraph.engine.noise.csrc", "mcgraph.engine.estimators.csrc", "mcgraph.optim.csrc"} <= sources, sources
    on_disk |= {"mcgraph.kernels"} | sources
    assert listed == on_disk, {"missing": sorted(on_disk - listed), "extra": sorted(listed - on_disk)}
    data = config["package-data"]
    for package in sources:
        assert data.get(package) == ["*.cpp"], (package, data)


def _engine_floor(module: str) -> int:
    part = module.split(".")[2]
    return next(i for i, names in enumerate(ENGINE_FLOORS) if part in names)


def test_the_engine_runs_noise_then_plan_then_estimators():
    """Inside the engine: the noise below the plan (families name their noise law), the plan below the
    estimators that consume it, the functional API on top; nothing imports a floor above its own."""
    bad = []
    for module, targets in _graph().items():
        if not module.startswith("mcgraph.engine."):
            continue
        for t in targets:
            if t.startswith("mcgraph.engine.") and _engine_floor(t) > _engine_floor(module):
                bad.append(f"{module} imports {t}")
    assert not bad, "\n".join(sorted(bad))


def test_no_top_level_kernels_package():
    """The top-level ``kernels/`` folder is no regular package: from the repository root ``import kernels``
    finds another installed package of that name (Hugging Face's) before this folder; ``mcgraph.kernels``
    is the only name of these modules."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "mcgraph" / "kernels").resolve() == (ROOT / "kernels").resolve()


#: The tests' areas, one folder each, named for the part of mcgraph (or of the checkout) they test.
TEST_AREAS = {"engine", "nn", "optim", "interop", "apps", "paper"}


def test_tests_live_in_their_areas():
    """Every test module is in an area folder; ``tests/support`` holds helpers and no tests; and no test
    module imports another (what two areas share is a ``support`` module)."""
    tests = ROOT / "tests"
    misplaced = [str(p.relative_to(tests)) for p in tests.rglob("test_*.py")
                 if p.parent.parent != tests or p.parent.name not in TEST_AREAS]
    assert not misplaced, f"test modules outside tests/{{{','.join(sorted(TEST_AREAS))}}}: {misplaced}"
    assert {p.name for p in tests.glob("*.py")} == {"conftest.py"}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")}
    assert folders == TEST_AREAS | {"support"}  # hidden tool caches (.ruff_cache, .benchmarks) aside
    imports = []
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            imports += [f"{path.relative_to(tests)} imports {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert not imports, imports
