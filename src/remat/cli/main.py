"""``remat`` entry point: parse the subcommand and turn remat's own errors into one line and exit 1."""

from __future__ import annotations

import argparse
import logging
import sys

from remat.cli import bench, measure, plan, profile, report
from remat.cli.common import err_console
from remat.errors import RematError

SUBCOMMANDS = {"bench": bench, "profile": profile, "plan": plan, "measure": measure, "report": report}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per subcommand."""
    parser = argparse.ArgumentParser(prog="remat", description="Measured activation checkpointing for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what remat does")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        module.add_parser(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(SUBCOMMANDS[args.command].run(args) or 0)
    except RematError as e:
        err_console.print(f"error: {e}", markup=False, soft_wrap=True)
        return 1
    except Exception as e:  # the model itself failed (or remat did): one line, the traceback with -v
        if args.verbose:
            raise
        err_console.print(f"error: {type(e).__name__}: {e} (run with -v for the traceback)", markup=False, soft_wrap=True)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
