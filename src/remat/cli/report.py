"""``remat report MODEL --budget 40%``: a self-contained HTML report, a Markdown summary and the plan's JSON."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from remat.apply import apply, remove
from remat.cli.bench import _plans
from remat.cli.common import (
    add_model_args,
    check_budgets,
    check_model,
    check_positive,
    console,
    load_workload,
    loop_options,
    note_high_budgets,
)
from remat.measure.compare import compare
from remat.measure.timeline import Timeline, timeline
from remat.plan import frontier
from remat.plan import plan as make_plan
from remat.plan.strategies import full
from remat.plan.types import Plan
from remat.profile import profile as run_profile
from remat.units import format_bytes

HELP = "write an HTML report (plots embedded), a Markdown summary and plan.json for a model's plans"


def add_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``remat report``."""
    add_model_args(p)
    p.add_argument("--budget", required=True, help="bytes ('1.5GiB') or share of the unplanned peak ('40%%')")
    p.add_argument(
        "--out", type=Path, default=Path("remat-report"), help="directory to write into (default remat-report/)"
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds of the bench (default 5)")


def _command(args: argparse.Namespace) -> str:
    """The command line, rebuilt from the parsed arguments (``sys.argv`` is not ours when called as a function)."""
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
    return shlex.join(words)


def check(args: argparse.Namespace) -> None:
    """Every mistake that can be seen without building the model, caught before anything is measured."""
    check_positive("--rounds", args.rounds)
    check_budgets([args.budget])
    check_model(args.model, args.sizes)
    from remat.report.plots import _require_matplotlib

    _require_matplotlib()  # fail before minutes of measuring, not after


def run(args: argparse.Namespace) -> int:
    """Profile, plan, bench every strategy, record timelines, draw the charts, write HTML, Markdown and plan.json."""
    from remat.report import write_charts, write_report
    from remat.report.html import REPORT_PLAN, verdict

    w = load_workload(args.model, args.sizes)
    with console.status(f"profiling {w.description}"):
        prof = run_profile(w.model, w.inputs, w.loss_fn, **loop_options(args))
    note_high_budgets([args.budget], prof)
    make_plan(prof, args.budget)  # an infeasible budget stops here, with the smallest feasible peak
    plans = _plans(prof, [], [args.budget])
    chosen = next(p for p in plans if p.strategy.startswith("optimal"))
    by_label = {p.strategy: p for p in plans}
    recorded: list[Plan] = [by_label["none"], by_label.get("full") or make_plan(prof, strategy=full()), chosen]

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("measuring", total=len(plans) + args.rounds + len(recorded) + 3)

        def tick(label: str) -> None:
            bar.update(task, advance=1, description=label)

        result = compare(
            w.model,
            w.inputs,
            w.loss_fn,
            plans,
            rounds=args.rounds,
            description=w.description,
            progress=tick,
            **loop_options(args),
        )
        timelines: list[Timeline] = []
        for p in recorded:
            apply(w.model, p)
            try:
                timelines.append(timeline(w.model, w.inputs, w.loss_fn, **loop_options(args)))
            finally:
                remove(w.model)
            tick(f"{p.strategy}: timeline")
        front = frontier(prof)
        tick("frontier")
        charts = write_charts(args.out, profile=prof, plan=chosen, result=result, frontier=front, timelines=timelines)
        tick("charts")
        html_path, md_path = write_report(
            args.out,
            profile=prof,
            plan=chosen,
            result=result,
            frontier=front,
            timelines=timelines,
            command=_command(args),
            description=w.description,
            charts=charts,
        )
        tick("report")
    for tl in timelines:
        console.print(f"timeline {tl.plan}: peak {format_bytes(tl.peak_bytes)} above held memory")
    for path in (*charts.values(), md_path, html_path.parent / REPORT_PLAN, html_path):
        console.print(f"wrote {path}")
    console.print(verdict(chosen, result, prof), highlight=False)
    return 0
