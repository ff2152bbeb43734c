"""Small C++ libraries compiled at first use and loaded with :mod:`ctypes`.

mcgraph's CPU loops that torch has no single operation for (the Philox noise stream of
:mod:`mcgraph.engine.noise.cpu_philox`, IVON's and VOGN's one-pass updates in :mod:`mcgraph.optim.cpu_kernels`) are
plain C++ sources with OpenMP and no torch headers. Each is compiled by one ``$CXX`` (default
``c++``) call, never at import, into ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) under a name that hashes the source, the flags and the CPU's
instruction-set flags, so a cache shared between machines never loads code built for another
CPU; later processes load the cached build. When the build fails (no compiler, or ``CXX`` names a
missing program) :meth:`NativeLibrary.load` returns ``None`` and
:meth:`NativeLibrary.unavailable_reason` says why; the callers keep their torch path.

``-ffp-contract=off`` keeps every multiply and add a separately rounded IEEE operation (no fused
multiply-adds the source does not write), so a loop that performs torch's element-wise operations
in torch's order gives torch's numbers bit for bit.

Example:
    >>> import pathlib
    >>> from mcgraph.engine.native import NativeLibrary
    >>> lib = NativeLibrary("demo", pathlib.Path("demo.cpp"), lambda dll: None)
    >>> lib.built()
    False
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import subprocess
import threading
from typing import Callable

#: The compiler flags of every build.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC",
         "-std=c++17")
#: Seconds a build may take before it counts as failed.
BUILD_TIMEOUT = 300


def cpu_flags() -> str:
    """The CPU's instruction-set flags (``/proc/cpuinfo``), or the platform's name for the processor."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def compiler() -> str:
    """The C++ compiler a build runs: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "").strip() or "c++"


def extensions_dir() -> pathlib.Path:
    """``$TORCH_EXTENSIONS_DIR``, else ``$XDG_CACHE_HOME/torch_extensions`` (``~/.cache`` by default)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")
    return pathlib.Path(root)


class NativeLibrary:
    """One C++ source, built once per machine and loaded once per process.

    Args:
        name: the library's name (the build folder is ``mcgraph_<name>_<hash>``).
        source: the ``.cpp`` file.
        declare: called with the loaded :class:`ctypes.CDLL`; sets the entry points' argument and
            result types and raises ``RuntimeError`` when the build does not match the caller's
            expectations (a stale build is then rebuilt once).
        flags: the compiler flags (:data:`FLAGS`).
    """

    def __init__(self, name: str, source: pathlib.Path, declare: Callable[[ctypes.CDLL], None],
                 flags=FLAGS) -> None:
        self.name = name
        self.source = pathlib.Path(source)
        self.declare = declare
        self.flags = tuple(flags)
        self._lock = threading.Lock()
        self._state: dict = {}  # "lib" (the loaded library) or "error" (why not), set once per process

    def build_path(self) -> pathlib.Path:
        """Where the library is (or will be) built: a name hashing source, flags and the CPU's flags."""
        h = hashlib.sha256()
        for part in (self.source.read_bytes(), " ".join(self.flags).encode(), cpu_flags().encode()):
            h.update(part)
        return extensions_dir() / f"mcgraph_{self.name}_{h.hexdigest()[:16]}" / f"{self.name}.so"

    def build(self, path: pathlib.Path, flags=None) -> None:
        """Compile the source into ``path`` (atomically: a concurrent process loads no file or a whole one)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp.so")
        cmd = [compiler(), *(self.flags if flags is None else flags), str(self.source), "-o", str(tmp)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                raise RuntimeError(f"{cmd[0]} exited with {done.returncode}: {last}")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def open(self, path: pathlib.Path) -> ctypes.CDLL:
        """Load a built file and declare its entry points."""
        lib = ctypes.CDLL(str(path))
        self.declare(lib)
        return lib

    def load(self):
        """The loaded library (built on the first call, cached on disk), or ``None`` when it cannot be had.

        Never raises: a failed build is remembered for the rest of the process and
        :meth:`unavailable_reason` returns its message.
        """
        state = self._state
        if "lib" in state or "error" in state:
            return state.get("lib")
        with self._lock:
            if "lib" not in state and "error" not in state:
                try:
                    path = self.build_path()
                    if not path.exists():
                        self.build(path)
                    try:
                        state["lib"] = self.open(path)
                    except (OSError, RuntimeError):  # a stale or damaged cached build: build it once more
                        self.build(path)
                        state["lib"] = self.open(path)
                except Exception as exc:  # noqa: BLE001 - any build or load failure means: the torch path
                    state["error"] = f"{type(exc).__name__}: {exc}"
        return state.get("lib")

    def built(self) -> bool:
        """Whether this process has already loaded the library (no build is attempted)."""
        return "lib" in self._state

    def unavailable_reason(self) -> str | None:
        """Why :meth:`load` returned ``None`` (``None`` when it loaded or was never tried)."""
        return self._state.get("error")
