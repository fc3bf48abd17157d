"""``remat report MODEL --budget 40%``: a self-contained HTML report, a Markdown summary and the plan's JSON.

``remat report --from DIR`` draws the report again from the JSON files of an earlier report (or of
``remat bench --out DIR``), measuring nothing (NOTE [ Report files ] in ``remat.report.data``).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from remat.cli.bench import say_skipped
from remat.cli.common import (
    add_model_args,
    add_split_arg,
    block_options,
    check_model,
    check_positive,
    console,
    load_workload,
    loop_flags,
    loop_of,
    loop_options,
    note_high_budgets,
    one_budget,
)
from remat.errors import RematError
from remat.profile import profile as run_profile
from remat.units import format_bytes

HELP = "write an HTML report (plots embedded), a Markdown summary and plan.json for a model's plans"


def add_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``remat report``."""
    add_model_args(p)
    add_split_arg(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--budget",
        action="append",
        help="bytes ('1.5GiB') or share of the unplanned peak ('40%%'); one (remat bench takes several)",
    )
    source.add_argument(
        "--from",
        dest="source",
        type=Path,
        metavar="DIR",
        help="draw the report from the JSON files in DIR (an earlier report's, or `remat bench --out DIR`), "
        "measuring nothing",
    )
    p.add_argument(
        "--out", type=Path, default=Path("remat-report"), help="directory to write into (default remat-report/)"
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds of the bench (default 5)")


def _command(args: argparse.Namespace) -> str:
    """The command line, rebuilt from the parsed arguments (``sys.argv`` is not ours when called as a function)."""
    if args.source is not None:
        return shlex.join(["remat", "report", "--from", str(args.source), "--out", str(args.out)])
    words = [
        "remat",
        "report",
        args.model,
        "--budget",
        args.budget,
        "--out",
        str(args.out),
        "--rounds",
        str(args.rounds),
    ]
    for item in args.sizes:
        words += ["--set", item]
    if getattr(args, "split", False):
        words.append("--split")
    return shlex.join(words + (loop_flags(loop_of(args)) or []))


def check(args: argparse.Namespace) -> None:
    """Every mistake that can be seen without building the model, caught before anything is measured."""
    if args.source is None:
        check_positive("--rounds", args.rounds)
        args.budget = one_budget(args.budget, "a report")  # one, from here on
        check_model(args.model, args.sizes)
    from remat.report.plots import _require_matplotlib

    _require_matplotlib()  # fail before minutes of measuring, not after
    if args.out.exists() and not args.out.is_dir():
        raise RematError(f"--out {str(args.out)!r}: this is a file, not a directory; give a directory to write into")


def run(args: argparse.Namespace) -> int:
    """Measure everything (``remat.report.collect``) or read it (``--from``), then write the report (``build``)."""
    from remat.report import ReportData, build, collect
    from remat.report.html import verdict

    if args.source is not None:
        data = ReportData.read(args.source)
        description = data.result.model
    else:
        w = load_workload(args.model, args.sizes)
        with console.status(f"profiling {w.description}"):
            prof = run_profile(w.model, w.inputs, w.loss_fn, **block_options(args, w.model), **loop_options(args))
        note_high_budgets([args.budget], prof)
        data = collect(
            w.model,
            w.inputs,
            w.loss_fn,
            budget=args.budget,
            profile=prof,
            rounds=args.rounds,
            description=w.description,
            skipped=say_skipped,
            **loop_options(args),
        )
        description = w.description
    with console.status("drawing the charts and writing the report"):
        written = build(args.out, data, command=_command(args), description=description)
    for tl in data.timelines:
        console.print(f"timeline {tl.plan}: peak {format_bytes(tl.peak_bytes)} above held memory")
    for path in (*written.charts.values(), *written.values, written.markdown, written.html):
        console.print(f"wrote {path}")
    console.print(verdict(data.plan, data.result, data.profile), highlight=False)
    return 0
