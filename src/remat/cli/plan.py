"""``remat plan MODEL --budget 40%``: the plan in words, predicted figures next to none and full, plan.json."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from remat.cli.common import (
    add_model_args,
    add_split_arg,
    block_options,
    check_budgets,
    check_model,
    console,
    load_workload,
    loop_options,
    note_high_budgets,
    read_profile,
    write_file,
)
from remat.plan import SOLVERS
from remat.plan import plan as make_plan
from remat.plan.strategies import full, none
from remat.profile import profile as run_profile
from remat.report.tables import plan_tree, plans_table

HELP = "solve for the fastest plan under a memory budget and show it (no training step is changed)"


def add_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``remat plan``."""
    add_model_args(p)
    add_split_arg(p)
    p.add_argument("--budget", required=True, help="bytes ('1.5GiB') or share of the unplanned peak ('40%%')")
    p.add_argument("--solver", default="optimal", choices=list(SOLVERS), help="default optimal")
    p.add_argument("--profile", type=Path, default=None, help="read this profile.json instead of profiling")
    p.add_argument("--out", type=Path, default=Path("plan.json"), help="where to write the plan (default plan.json)")


def check(args: argparse.Namespace) -> None:
    """Every mistake that can be seen without building the model, caught before anything is measured."""
    check_budgets([args.budget])
    if args.profile is not None:
        read_profile(args.profile)
    check_model(args.model, args.sizes)


def run(args: argparse.Namespace) -> int:
    """Profile (or read a profile), solve, print the plan in words and the comparison, write the JSON."""
    if args.profile is not None:
        prof = read_profile(args.profile)  # the model is not built: the profile holds all the solver reads
    else:
        w = load_workload(args.model, args.sizes)
        with console.status(f"profiling {w.description}"):
            prof = run_profile(w.model, w.inputs, w.loss_fn, **block_options(args, w.model), **loop_options(args))
    note_high_budgets([args.budget], prof)
    chosen = make_plan(prof, args.budget, solver=args.solver)
    console.print(plan_tree(chosen))
    console.print(plans_table([make_plan(prof, strategy=none()), make_plan(prof, strategy=full()), chosen]))
    write_file(args.out, chosen.to_json())
    again = shlex.join(
        ["remat", "measure", args.model, *(f"--set={item}" for item in args.sizes), "--plan", str(args.out)]
    )
    console.print(f"wrote {args.out}; measure it with: {again}", highlight=False)
    return 0
