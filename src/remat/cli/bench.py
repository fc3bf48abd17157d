"""``remat bench [MODEL] [--budget 40%]``: every strategy (and the solvers) measured in one run."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from remat._progress import progress
from remat.cli.common import (
    add_model_args,
    add_split_arg,
    block_options,
    check_budgets,
    check_model,
    check_out_file,
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
from remat.errors import BudgetInfeasibleError, RematError
from remat.measure.compare import BenchResult, compare
from remat.plan import frontier
from remat.plan import plan as make_plan
from remat.plan.strategies import parse_strategy
from remat.profile import Profile
from remat.profile import profile as run_profile
from remat.report.tables import bench_table, budget_verdicts

HELP = "measure every checkpointing strategy on a model: peak memory, step time, gradient equality"

log = logging.getLogger(__name__)


def add_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``remat bench``."""
    add_model_args(p)
    add_split_arg(p)
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
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="write profile.json, bench.json, frontier.json and plan.json into DIR, for `remat report --from DIR`",
    )


def say_skipped(solver: str, budget: str, error: BudgetInfeasibleError) -> None:
    """Print that ``solver`` cannot meet ``budget`` (its plan is left out of the bench)."""
    console.print(f"[yellow]skipped {solver} at {budget}:[/] {error}")


def check(args: argparse.Namespace) -> None:
    """Every mistake that can be seen without building the model, caught before anything is measured."""
    check_positive("--rounds", args.rounds)
    check_budgets(args.budget)
    parse_strategies(args.strategy)
    check_model(args.model, args.sizes)
    if args.plots is not None:
        from remat.report.plots import _require_matplotlib

        _require_matplotlib()  # fail before minutes of measuring, not after
    # Where the results go, checked before minutes of measuring too.
    for flag, d in (("--plots", args.plots), ("--out", args.out)):
        if d is not None and d.exists() and not d.is_dir():
            raise RematError(f"{flag} {str(d)!r}: this is a file, not a directory; give a directory to write into")
    check_out_file("--json", args.json)


def run(args: argparse.Namespace) -> int:
    """Profile, build the plans, measure them interleaved, print the table, write JSON (and plots)."""
    from remat.report import bench_plans

    strategies = parse_strategies(args.strategy)
    w = load_workload(args.model, args.sizes)
    check_strategies_fit(strategies, w.model)  # blocks a strategy names, before the profile
    with console.status(f"profiling {w.description}"):
        prof = run_profile(w.model, w.inputs, w.loss_fn, **block_options(args, w.model), **loop_options(args))
    note_high_budgets(args.budget, prof)
    plans = bench_plans(prof, strategies, args.budget, skipped=say_skipped)
    with progress(None, len(plans) + args.rounds, "bench") as tick:
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
    console.print(bench_table(result))
    for line in budget_verdicts(result):
        console.print(line)
    if args.json is not None:
        write_file(args.json, result.to_json())
        console.print(f"wrote {args.json}")
    if args.plots is not None or args.out is not None:
        _write_values_and_plots(args, prof, result)
    return 0


def _write_values_and_plots(args: argparse.Namespace, prof: Profile, result: BenchResult) -> None:
    """``--out DIR`` and ``--plots DIR``: the values a report reads, and the charts drawn from them."""
    from remat.report import ReportData, heatmap_plan, write_bench_plots

    # The heatmap's plan: the bench's optimal plan at the tightest budget it fits, else `full`.
    shown = heatmap_plan(result) or make_plan(prof, strategy=parse_strategy("full"))
    front = frontier(prof)
    if args.out is not None:
        try:
            written = ReportData(prof, shown, result, front).write(args.out)
        except OSError as e:
            raise RematError(f"cannot write into {str(args.out)!r}: {e.strerror}; check the path") from None
        for path in written:
            console.print(f"wrote {path}")
    if args.plots is not None:
        try:
            written = write_bench_plots(result, prof, args.plots, frontier=front, plan=shown)
        except OSError as e:
            raise RematError(f"cannot write into {str(args.plots)!r}: {e.strerror}; check the path") from None
        for path in written:
            console.print(f"wrote {path}")
