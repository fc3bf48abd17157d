"""``remat bench [MODEL] [--budget 40%]``: every strategy (and the solvers) measured in one run."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from remat.cli.common import (
    add_model_args,
    check_budgets,
    check_model,
    check_positive,
    check_strategies_fit,
    console,
    load_workload,
    loop_options,
    note_high_budgets,
    parse_strategies,
    strategies_help,
    write_file,
)
from remat.errors import BudgetInfeasibleError
from remat.measure.compare import compare
from remat.plan import plan as make_plan
from remat.plan.strategies import Strategy, bench_strategies, parse_strategy
from remat.plan.types import Plan
from remat.profile import Profile
from remat.profile import profile as run_profile
from remat.report.tables import bench_table, budget_verdicts

HELP = "measure every checkpointing strategy on a model: peak memory, step time, gradient equality"

log = logging.getLogger(__name__)


def add_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``remat bench``."""
    add_model_args(p)
    p.epilog = f"{p.epilog}\n\n{strategies_help()}"
    p.add_argument(
        "--budget",
        action="append",
        default=[],
        help="also solve optimal and knapsack plans for this budget ('40%%', '1.5GiB'); repeatable",
    )
    p.add_argument(
        "--strategy",
        action="append",
        default=[],
        help="bench only these strategies, e.g. --strategy 'every_nth(2)' (default: one of each)",
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5)")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    p.add_argument("--plots", type=Path, default=None, help="write the charts (PNG) into this directory")


def _plans(prof: Profile, chosen: list[Strategy], budgets: list[str]) -> list[Plan]:
    strategies = list(chosen) or bench_strategies(prof.blocks, prof)
    if not any(s.name == "none" for s in strategies):
        strategies.insert(0, parse_strategy("none"))
    strategies.sort(key=lambda s: s.name != "none")
    plans = [make_plan(prof, strategy=s) for s in strategies]
    for b in budgets:
        for solver in ("optimal", "knapsack"):
            try:
                p = make_plan(prof, b, solver=solver)
            except BudgetInfeasibleError as e:
                console.print(f"[yellow]skipped {solver} at {b}:[/] {e}")
                continue
            plans.append(p.__class__(**{**p.__dict__, "strategy": f"{p.strategy} @ {b}"}))
    return plans


def check(args: argparse.Namespace) -> None:
    """Every mistake that can be seen without building the model, caught before anything is measured."""
    check_positive("--rounds", args.rounds)
    check_budgets(args.budget)
    parse_strategies(args.strategy)
    check_model(args.model, args.sizes)
    if args.plots is not None:
        from remat.report.plots import _require_matplotlib

        _require_matplotlib()  # fail before minutes of measuring, not after


def run(args: argparse.Namespace) -> int:
    """Profile, build the plans, measure them interleaved, print the table, write JSON (and plots)."""
    strategies = parse_strategies(args.strategy)
    w = load_workload(args.model, args.sizes)
    check_strategies_fit(strategies, w.model)  # blocks a strategy names, before the profile
    with console.status(f"profiling {w.description}"):
        prof = run_profile(w.model, w.inputs, w.loss_fn, **loop_options(args))
    note_high_budgets(args.budget, prof)
    plans = _plans(prof, strategies, args.budget)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("measuring", total=len(plans) + args.rounds)
        result = compare(
            w.model,
            w.inputs,
            w.loss_fn,
            plans,
            rounds=args.rounds,
            description=w.description,
            progress=lambda label: bar.update(task, advance=1, description=label),
            **loop_options(args),
        )
    console.print(bench_table(result))
    for line in budget_verdicts(result):
        console.print(line)
    if args.json is not None:
        write_file(args.json, result.to_json())
        console.print(f"wrote {args.json}")
    if args.plots is not None:
        from remat.report import write_bench_plots

        for path in write_bench_plots(result, prof, args.plots):
            console.print(f"wrote {path}")
    return 0
