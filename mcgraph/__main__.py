"""``python -m mcgraph {train,bench,env} ...`` (also the ``mcgraph`` console script).

``mcgraph bench`` runs the benchmark harness, which is development code: it lives in the ``bench``
package of a source checkout, not in the installed wheel. From a checkout (an editable install, or
``python -m mcgraph`` at its root) the command finds it; from a wheel it says how to get it.
"""

from __future__ import annotations

import sys
from pathlib import Path

#: subcommand -> (module with ``main(argv)``, one line for ``--help``)
COMMANDS = {
    "train": ("mcgraph.apps.train", "train a Bayesian network on a packaged dataset (ELBO, or --optimizer)"),
    "bench": ("bench.harness.cli", "memory and time vs M: mcgraph against direct MC and gradient accumulation"),
    "env": ("mcgraph.apps.env", "versions, devices, compiled libraries and backends in effect (for a bug report)"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: mcgraph COMMAND [options]   (mcgraph COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {line}" for name, (_, line) in COMMANDS.items()]
    return "\n".join(lines)


def _checkout_root() -> Path | None:
    """The source checkout this mcgraph was imported from (it holds ``bench/``), or ``None`` (a wheel)."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "bench" / "__init__.py").is_file() and (root / "pyproject.toml").is_file() else None


_NO_BENCH = ("mcgraph bench: the benchmark harness is development code that ships with the source, not with the "
             "installed package. Clone the repository and run `python -m bench` (or `mcgraph bench`) at its root "
             "after `pip install -e .[bench]`.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        got = f"unknown command {argv[0]!r}\n" if argv else ""
        print(got + _usage(), file=sys.stderr)
        return 2
    import importlib

    if argv[0] == "bench":
        root = _checkout_root()
        if root is None:
            print(_NO_BENCH, file=sys.stderr)
            return 2
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
    module = importlib.import_module(COMMANDS[argv[0]][0])
    code = int(module.main(argv[1:]) or 0)
    from mcgraph.apps import launch

    if launch.joined_gloo():  # a torchrun rank: leave before gloo's threads meet interpreter shutdown
        launch.exit_process(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
