"""``python -m mcgraph {bench,train} ...`` (also the ``mcgraph`` console script)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"bench": "mcgraph.apps.bench.cli", "train": "mcgraph.apps.train"}
    if not argv or argv[0] not in commands:
        print(f"usage: mcgraph {{{','.join(commands)}}} [options]   (mcgraph COMMAND --help)", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(commands[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
