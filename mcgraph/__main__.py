"""``python -m mcgraph {bench,train} ...`` (also the ``mcgraph`` console script)."""

from __future__ import annotations

import sys

#: subcommand -> (module with ``main(argv)``, one line for ``--help``)
COMMANDS = {
    "train": ("mcgraph.apps.train", "train a Bayesian network on a packaged dataset (ELBO, or --optimizer)"),
    "bench": ("mcgraph.apps.bench.cli", "memory and time vs M: mcgraph against direct MC and gradient accumulation"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: mcgraph COMMAND [options]   (mcgraph COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {line}" for name, (_, line) in COMMANDS.items()]
    return "\n".join(lines)


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

    module = importlib.import_module(COMMANDS[argv[0]][0])
    code = int(module.main(argv[1:]) or 0)
    from mcgraph.apps import launch

    if launch.joined_gloo():  # a torchrun rank: leave before gloo's threads meet interpreter shutdown
        launch.exit_process(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
