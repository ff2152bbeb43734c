"""``python -m paper_tables all|<target> … [--quick] [--out DIR]`` (targets: :data:`paper_tables.TARGETS`)."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

from . import TARGETS, get_target


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m paper_tables", description=(
        "Regenerate the paper's tables and figures at CPU scale, side by side with the published values. "
        "Writes <out>/<target>.md, .png, .json and <out>/README.md."))
    p.add_argument("targets", nargs="+", choices=("all",) + tuple(TARGETS), metavar="TARGET",
                   help=f"'all' or any of: {', '.join(TARGETS)}")
    p.add_argument("--quick", action="store_true", help="toy scale (the CI smoke test; all targets in minutes)")
    p.add_argument("--out", default="paper_tables/out", help="output folder (default paper_tables/out)")
    p.add_argument("--seed", type=int, default=0, help="base seed of every target (recorded in its output)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--budget-minutes", type=float, default=None, help="stop the long, resumable runs "
                   "(sparse_vd_table, vogn_table at the seeds' schedules) after the epoch that passes this many "
                   "minutes; the tables then report the epochs reached, and running again continues them")
    p.add_argument("--keep-going", action="store_true", help="run the remaining targets when one fails")
    p.add_argument("--render-only", action="store_true", help="rebuild <target>.md/.png from an existing "
                   "<target>.json without measuring (fig2_right, fig1_fig6, fig7_fig8)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.budget_minutes is not None:
        if not args.budget_minutes >= 0:
            raise SystemExit(f"--budget-minutes must be >= 0, got {args.budget_minutes}")
        from .common import set_deadline

        set_deadline(60 * args.budget_minutes)
    names = list(TARGETS) if "all" in args.targets else list(dict.fromkeys(args.targets))
    failed = []
    start = time.perf_counter()
    for name in names:
        t = time.perf_counter()
        print(f"[paper_tables] {name} ({'quick' if args.quick else 'full'}) …", file=sys.stderr, flush=True)
        try:
            if args.render_only:
                module = importlib.import_module(TARGETS[name])
                if not hasattr(module, "rerender"):
                    print(f"[paper_tables] {name}: no --render-only (cheap: run it)", file=sys.stderr)
                    continue
                data = module.rerender(args.out)
            else:
                data = get_target(name)(args.out, quick=args.quick, seed=args.seed)
        except Exception:  # noqa: BLE001 — reported; with --keep-going the other targets still run
            traceback.print_exc()
            failed.append(name)
            if not args.keep_going:
                break
            continue
        print(f"[paper_tables] {name}: {data['status']} in {time.perf_counter() - t:.1f} s -> "
              f"{args.out}/{name}.md", file=sys.stderr, flush=True)
    print(f"[paper_tables] done in {time.perf_counter() - start:.1f} s; index: {args.out}/README.md"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
