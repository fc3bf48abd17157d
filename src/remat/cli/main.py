"""``remat`` entry point: parse the subcommand and turn remat's own errors into one line and exit 1."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import remat
from remat.cli import bench, measure, plan, profile, report
from remat.cli.common import err_console, models_help, strategies_help
from remat.errors import RematError

SUBCOMMANDS = {"bench": bench, "profile": profile, "plan": plan, "measure": measure, "report": report}

log = logging.getLogger(__name__)

# NOTE [ Timing environment ]
# On a busy or oversubscribed CPU, OpenMP's default wait policy makes idle worker threads spin for
# the core another process needs: measured on this project's 2-core machine with two busy processes
# beside it, `remat profile gpt` took 98 s with the default and 15 s with OMP_WAIT_POLICY=PASSIVE.
# The malloc settings keep freed memory in the process (no mmap/munmap or trim per step), which
# steadies step times. glibc reads MALLOC_* once at process start and libgomp reads OMP_* when it is
# loaded (at `import torch`, before main() runs), so setting them from Python is too late: the
# `remat` program re-executes itself once with the missing ones set. Values the user already set are
# kept (OMP_WAIT_POLICY=ACTIVE is the faster choice on an idle machine), the guard variable stops a
# second re-exec, and main(argv) called from Python never re-executes: the user's own process and
# training keep their settings. The Makefile's BENCH_ENV sets the same values for `make test`/`demo`.
TIMING_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "33554432",
    "MALLOC_TRIM_THRESHOLD_": "17179869184",
    "MALLOC_TOP_PAD_": "0",
    "OMP_WAIT_POLICY": "PASSIVE",
}
_REEXEC_GUARD = "_REMAT_TIMING_ENV"
_VALUE_OPTIONS = frozenset({"--budget", "--rounds", "--steps", "--repeats"})


def _add_verbose(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=default, help="log what remat does; tracebacks of failures"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per subcommand; ``--help`` lists models and strategies."""
    parser = argparse.ArgumentParser(
        prog="remat",
        description="Measured activation checkpointing for PyTorch.",
        epilog=f"{models_help()}\n\n{strategies_help()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"remat {remat.__version__}")
    _add_verbose(parser, False)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_parser(p)
        # -v after the subcommand too; SUPPRESS keeps a -v given before it from being reset to False.
        _add_verbose(p, argparse.SUPPRESS)
    return parser


def _negative_values(argv: list[str]) -> list[str]:
    # argparse reads "--budget -1GiB" as two options; join it to "--budget=-1GiB" so that the budget
    # check, not a usage line, says what is wrong with it.
    out: list[str] = []
    for word in argv:
        if out and out[-1] in _VALUE_OPTIONS and word[:1] == "-" and word[1:2].isdigit():
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def _times_steps(args: argparse.Namespace) -> bool:
    # `remat plan --profile profile.json` only solves; every other subcommand profiles or times steps.
    return not (args.command == "plan" and getattr(args, "profile", None) is not None)


def _reexec_with_timing_env() -> None:
    """Re-execute this program once with TIMING_ENV's missing variables set (NOTE [ Timing environment ])."""
    missing = {k: v for k, v in TIMING_ENV.items() if k not in os.environ}
    if not missing or os.environ.get(_REEXEC_GUARD) or os.name != "posix":
        return
    env = {**os.environ, **missing, _REEXEC_GUARD: "1"}
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError as e:  # cannot re-execute (unusual sandboxes): run here, with timings as they are
        log.info("could not re-execute with %s (%s); timings may be noisy", " ".join(missing), e)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Args:
        argv: The arguments after ``remat``; ``None`` reads ``sys.argv`` and, for subcommands that time
            steps, first re-executes the program with stable timing settings (NOTE [ Timing environment ]).
    """
    args = build_parser().parse_args(_negative_values(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    command = SUBCOMMANDS[args.command]
    try:
        command.check(args)  # the user's mistakes, in under a second: before any re-exec, model or profile
        if argv is None and _times_steps(args):
            _reexec_with_timing_env()
        return int(command.run(args) or 0)
    except RematError as e:
        # One raised from a failure of the user's code (their file, factory or model: `raise ... from e`)
        # holds that failure as its cause, whose traceback -v promises as for any failure inside the model.
        if args.verbose and e.__cause__ is not None:
            raise
        err_console.print(f"error: {e}", markup=False, soft_wrap=True)
        return 1
    except Exception as e:  # the model itself failed (or remat did): one line, the traceback with -v
        if args.verbose:
            raise
        err_console.print(
            f"error: {type(e).__name__}: {e} (run with -v for the traceback)", markup=False, soft_wrap=True
        )
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
