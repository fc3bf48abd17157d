"""Running the pipeline for a bench or a report: profile -> plans -> bench -> timelines -> frontier.

The one place in ``remat.report`` that plans and measures; the charts and documents draw the values
it returns (:class:`remat.report.data.ReportData`) and never call it. ``remat bench`` and
``remat report`` are thin wrappers over these functions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from remat._progress import progress as show_progress
from remat.apply import apply, remove
from remat.core.trace import Grads, OptimizerLike
from remat.errors import BudgetInfeasibleError
from remat.measure.compare import BenchPlan, compare
from remat.measure.timeline import timeline
from remat.plan.frontier import frontier
from remat.plan.planner import plan as make_plan
from remat.plan.strategies import Strategy, bench_strategies, parse_strategy
from remat.plan.types import Plan
from remat.profile import profile as run_profile
from remat.profile.types import Profile
from remat.report.data import ReportData

__all__ = ["BENCH_SOLVERS", "bench_plans", "collect"]

log = logging.getLogger(__name__)

BENCH_SOLVERS = ("optimal", "knapsack")
"""The solvers a bench runs at each budget, in this order (``remat.plan(profile, budget, solver=...)``)."""


def bench_plans(
    profile: Profile,
    strategies: Sequence[Strategy] = (),
    budgets: Sequence[str] = (),
    *,
    skipped: Callable[[str, str, BudgetInfeasibleError], None] | None = None,
) -> list[BenchPlan]:
    """The plans of a bench: the plain model first, then each strategy, then each solver at each budget.

    Args:
        profile: From ``remat.profile``.
        strategies: The strategies to bench (default: one of each, ``bench_strategies``); ``none`` is
            added first when missing.
        budgets: Budgets to solve for with each of :data:`BENCH_SOLVERS` (``"40%"``, ``"1.5GiB"``); each
            plan is labelled ``"<solver label> @ <budget>"``.
        skipped: Called with ``(solver, budget, error)`` for a budget a solver cannot meet (the plan is
            left out); default: a logged warning.

    Returns:
        The plans, each with the solver that made it (``None`` for a strategy).
    """
    chosen = list(strategies) or bench_strategies(profile.blocks, profile)
    if not any(s.name == "none" for s in chosen):
        chosen.insert(0, parse_strategy("none"))
    chosen.sort(key=lambda s: s.name != "none")
    out = [BenchPlan(make_plan(profile, strategy=s)) for s in chosen]
    for budget in budgets:
        for solver in BENCH_SOLVERS:
            try:
                p = make_plan(profile, budget, solver=solver)
            except BudgetInfeasibleError as e:
                if skipped is None:
                    log.warning("skipped %s at %s: %s", solver, budget, e)
                else:
                    skipped(solver, budget, e)
                continue
            out.append(BenchPlan(replace(p, strategy=f"{p.strategy} @ {budget}"), solver))
    return out


def collect(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    budget: str,
    profile: Profile | None = None,
    rounds: int = 5,
    description: str = "",
    grads: Grads | str = Grads.NONE,
    optimizer: OptimizerLike | None = None,
    progress: bool | None = None,
    skipped: Callable[[str, str, BudgetInfeasibleError], None] | None = None,
) -> ReportData:
    """Everything a report draws, measured on one model: what ``remat report MODEL --budget B`` runs.

    Profiles the model (unless ``profile`` is given), solves the optimal plan at ``budget`` (the
    report's plan), benches it with every strategy and both solvers (:func:`bench_plans`), records the
    timelines of the plain model, ``full`` and the plan, and computes the optimal frontier.

    Args:
        model: The model (left as it was).
        inputs: A tensor, a tuple of positional arguments or a dict of keyword arguments.
        loss_fn: Maps the model's output to a scalar loss.
        budget: Bytes (``"1.5GiB"``) or a share of the unplanned peak (``"40%"``).
        profile: The model's profile, if already measured (``remat.profile``).
        rounds: Interleaved timing rounds of the bench, >= 1.
        description: One line naming the workload (the bench's ``model``).
        grads: The loop's gradients, ``"none"`` or ``"held"`` (see ``remat.measure``).
        optimizer: The optimizer whose step ends each iteration, a factory of one, or ``None``.
        progress: Show a progress bar (``None``: when standard error is a terminal).
        skipped: Called for a solver that cannot meet ``budget``, as in :func:`bench_plans`.

    Returns:
        The :class:`remat.report.data.ReportData`, ready for :func:`remat.report.build`.

    Raises:
        BudgetInfeasibleError: If no plan fits ``budget`` (before anything is benched).
    """
    loop: dict[str, Any] = {"grads": grads, "optimizer": optimizer}
    prof = profile if profile is not None else run_profile(model, inputs, loss_fn, progress=progress, **loop)
    make_plan(prof, budget)  # an infeasible budget stops here, with the smallest feasible peak
    entries = bench_plans(prof, budgets=[budget], skipped=skipped)
    chosen = next(e.plan for e in entries if e.solver == "optimal")
    full = parse_strategy("full")
    recorded: list[Plan] = [
        entries[0].plan,  # the plain model (bench_plans puts it first)
        next((e.plan for e in entries if e.plan.strategy == full.label), None) or make_plan(prof, strategy=full),
        chosen,
    ]
    with show_progress(progress, len(entries) + rounds + len(recorded) + 1, "report") as tick:
        result = compare(model, inputs, loss_fn, entries, rounds=rounds, description=description, progress=tick, **loop)
        timelines = []
        for p in recorded:
            apply(model, p)
            try:
                timelines.append(timeline(model, inputs, loss_fn, **loop))
            finally:
                remove(model)
            tick(f"{p.strategy}: timeline")
        front = frontier(prof)
        tick("frontier")
    return ReportData(prof, chosen, result, front, tuple(timelines))
