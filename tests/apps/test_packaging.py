"""mcgraph as users install it: the sdist and wheel of ``python -m build``, the wheel in a fresh virtual
environment with the CPU build of torch and nothing else of ours, used from outside the checkout; and, in
the checkout, ``mcgraph.kernels`` beside Hugging Face's ``kernels`` package.

The fresh environment is built once for this module: ``python -m venv --without-pip``, then this
interpreter's pip installs into it (``pip --python``, which spares bootstrapping a second pip) the CPU build
``torch==2.13.0`` first, then the wheel with its dependencies and scikit-learn (the README's quick start
loads its digits), without compiling bytecode (``--no-compile``: the imports compile what they use). Every
command there runs with the working directory in a temporary folder and no ``PYTHONPATH``, so nothing of the
checkout can be imported by accident, and with its own ``TORCH_EXTENSIONS_DIR``, so the compiled CPU
libraries are built from the wheel's own C++ sources rather than loaded from a cache.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from support.doc_blocks import python_blocks
from support.paths import ROOT

pytestmark = pytest.mark.integration

#: The CPU build of torch the Makefile installs (pip takes it from this machine's disk; elsewhere from PyPI).
TORCH = "torch==2.13.0"
#: What the README's quick start needs besides mcgraph (it loads scikit-learn's digits).
QUICK_START_NEEDS = ("scikit-learn",)
TIMEOUT = 900


def _run(cmd, *, cwd, env=None, timeout=TIMEOUT, check=True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited with {done.returncode}\n"
                    f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}")
    return done


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would let the checkout leak into a subprocess."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV",
                                                             "PYTHONSTARTUP", "MCGRAPH_BACKEND")}
    env.setdefault("OMP_NUM_THREADS", "1")  # the CI machine's two cores are shared
    return {**env, **extra}


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """``python -m build``: the sdist, then the wheel built from the unpacked sdist (so the wheel holds only
    what the sdist carries)."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", out, ROOT], cwd=ROOT, env=_clean_env())
    sdists, wheels = sorted(out.glob("mcgraph-*.tar.gz")), sorted(out.glob("mcgraph-*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in out.iterdir())
    return {"sdist": sdists[0], "wheel": wheels[0]}


class WheelEnv:
    """A fresh virtual environment holding the wheel; :meth:`run` runs a command there from a temporary folder."""

    def __init__(self, root: Path, work: Path, extensions: Path) -> None:
        self.root, self.work, self.extensions = root, work, extensions
        self.python = root / "bin" / "python"

    def run(self, *cmd, check=True, timeout=TIMEOUT) -> subprocess.CompletedProcess:
        env = _clean_env(TORCH_EXTENSIONS_DIR=str(self.extensions), PATH=f"{self.root / 'bin'}{os.pathsep}"
                                                                          f"{os.environ.get('PATH', '')}")
        return _run(cmd, cwd=self.work, env=env, check=check, timeout=timeout)

    def python_json(self, code: str):
        """Runs ``code`` in the environment's Python; it prints one JSON line last, returned here."""
        return json.loads(self.run(self.python, "-c", code).stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wheel_env(dists, tmp_path_factory) -> WheelEnv:
    base = tmp_path_factory.mktemp("wheel-env")
    env = WheelEnv(base / "venv", base / "work", base / "torch_extensions")
    env.work.mkdir()
    _run([sys.executable, "-m", "venv", "--without-pip", env.root], cwd=base, env=_clean_env())
    pip = [sys.executable, "-m", "pip", "--python", env.python, "install", "-q", "--no-compile"]
    _run([*pip, TORCH], cwd=base, env=_clean_env())
    _run([*pip, dists["wheel"], *QUICK_START_NEEDS], cwd=base, env=_clean_env())
    return env


def test_readme_quick_start_runs_from_the_wheel(wheel_env):
    quick_start = python_blocks((ROOT / "README.md").read_text())[0]  # the first python block of the README is its quick start
    assert "mcgraph" in quick_start, quick_start
    done = wheel_env.run(wheel_env.python, "-c", quick_start)
    accuracy = float(done.stdout.split("test accuracy")[-1].split()[0])
    assert accuracy > 0.8, done.stdout


def test_the_wheel_imports_its_kernels_and_builds_the_compiled_cpu_libraries_from_its_sources(wheel_env):
    got = wheel_env.python_json("""if True:
        import json, pathlib
        import mcgraph, mcgraph.kernels.reference as reference
        from mcgraph.engine.noise import cpu_philox
        from mcgraph.optim import cpu_kernels
        print(json.dumps({"mcgraph": mcgraph.__file__, "reference": reference.__file__,
                          "philox": cpu_philox.extension() is not None, "why": cpu_philox.unavailable_reason(),
                          "philox_build": str(cpu_philox.build_path()),
                          "ivon": cpu_kernels.library() is not None, "ivon_why": cpu_kernels.unavailable_reason()}))
    """)
    site = wheel_env.root.resolve()
    for name in ("mcgraph", "reference"):
        assert Path(got[name]).resolve().is_relative_to(site), got  # the wheel's copy, not the checkout's
    assert got["philox"], got["why"]
    assert got["ivon"], got["ivon_why"]
    assert Path(got["philox_build"]).is_relative_to(wheel_env.extensions) and Path(got["philox_build"]).is_file()


def test_the_console_script_from_the_wheel(wheel_env):
    mcgraph = wheel_env.root / "bin" / "mcgraph"
    helped = wheel_env.run(mcgraph, "--help")
    assert all(name in helped.stdout for name in ("train", "bench", "env")), helped.stdout
    bench = wheel_env.run(mcgraph, "bench", check=False)
    assert bench.returncode == 2 and "ships with the source" in bench.stderr, (bench.returncode, bench.stderr)
    report = wheel_env.run(mcgraph, "env", "--no-build").stdout
    assert "installed package" in report and "triton" in report, report
    assert [line for line in report.splitlines() if line.split()[:1] == ["triton"]][0].split()[1:] == \
        ["not", "installed"], report


def test_a_cpu_only_install_has_no_triton(wheel_env):
    """``triton`` is an extra: torch's CUDA wheels bring their own, and a CPU install needs none."""
    got = wheel_env.python_json("""if True:
        import importlib.metadata, importlib.util, json
        print(json.dumps({"spec": importlib.util.find_spec("triton") is not None,
                          "requires": importlib.metadata.requires("mcgraph")}))
    """)
    assert not got["spec"], got
    assert all("extra ==" in r for r in got["requires"] if r.startswith("triton")), got["requires"]


def _repository_files(pattern: str, base: Path) -> set[str]:
    return {p.relative_to(base).as_posix() for p in base.glob(pattern)}


def test_the_sdist_and_the_wheel_carry_the_kernels_and_the_cpp_sources(dists):
    """``mcgraph/kernels`` links to the top-level ``kernels/`` folder: both archives hold its files under
    ``mcgraph/kernels/``, and the C++ sources compiled at first use."""
    kernels = {f"mcgraph/kernels/{name}" for name in _repository_files("*.py", ROOT / "kernels")}
    sources = _repository_files("mcgraph/**/csrc/*.cpp", ROOT)
    assert kernels and len(sources) >= 3, (kernels, sources)
    with tarfile.open(dists["sdist"]) as sdist:
        in_sdist = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    with zipfile.ZipFile(dists["wheel"]) as wheel:
        in_wheel = set(wheel.namelist())
    assert kernels | sources <= in_sdist, sorted((kernels | sources) - in_sdist)
    assert kernels | sources <= in_wheel, sorted((kernels | sources) - in_wheel)


def _python_in(cwd: Path, code: str) -> str:
    return _run([sys.executable, "-c", code], cwd=cwd, env=_clean_env()).stdout.strip()


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _installed("kernels"),
                    reason="Hugging Face's kernels package is not installed (make interop installs it with transformers)")
def test_hugging_face_kernels_is_not_shadowed_from_the_repository_root():
    """From the root of the checkout (on ``sys.path`` first) ``import kernels`` is the installed package: the
    top-level ``kernels/`` folder has no ``__init__.py``, so it is at most a namespace portion, which any
    regular package of that name wins over."""
    installed = Path(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")).resolve()
    where = Path(_python_in(ROOT, "import kernels; print(kernels.__file__)"))
    assert where.resolve() == installed, where


@pytest.mark.parametrize("place", ["repository root", "elsewhere"])
def test_mcgraph_kernels_imports_from_the_editable_install(place, tmp_path):
    cwd = ROOT if place == "repository root" else tmp_path
    where = Path(_python_in(cwd, "import mcgraph.kernels.reference as r; print(r.__file__)"))
    assert where.resolve() == (ROOT / "kernels" / "reference.py").resolve(), where
