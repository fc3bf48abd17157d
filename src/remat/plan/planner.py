"""``remat.plan`` and ``remat.frontier``: from a measured profile to the fastest plan that fits a budget."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from remat.core.ops import Keep, Op, ops_repr
from remat.errors import BudgetInfeasibleError, RematError
from remat.plan.chain import Chain, chain_of
from remat.plan.solver import min_peak, min_peak_plan, simulate, solve
from remat.plan.strategies import STRATEGIES, Strategy
from remat.plan.types import Plan
from remat.units import Budget, format_bytes, parse_budget

if TYPE_CHECKING:
    from remat.profile.types import Profile

__all__ = ["SOLVERS", "plan", "plan_from_ops"]

log = logging.getLogger(__name__)


def _nested(profile: Profile) -> bool:
    # Segments of several blocks only across boundaries where the chain model holds (Chain.joinable):
    # the DP respects them, so nested plans are always allowed.
    return True


def _solve_optimal(profile: Profile, chain: Chain, headroom: int) -> tuple[Op, ...] | None:
    # NOTE [ Keep variants ]: the optimal solver may also keep a block with its attention/FFN checkpointed.
    return solve(chain, headroom, nested=_nested(profile), sub_costs=profile.sub_costs())


def _solve_knapsack(profile: Profile, chain: Chain, headroom: int) -> tuple[Op, ...] | None:
    return solve(chain, headroom, nested=False)


SOLVERS: dict[str, Callable[[Profile, Chain, int], tuple[Op, ...] | None]] = {
    "optimal": _solve_optimal,
    "knapsack": _solve_knapsack,
}


def plan_from_ops(profile: Profile, ops: tuple[Op, ...], label: str, budget_bytes: int | None = None) -> Plan:
    """A plan for ``ops`` on ``profile``'s blocks, with its simulated peak and recompute time."""
    sim = simulate(chain_of(profile), ops, profile.sub_costs())
    return Plan(
        strategy=label,
        blocks=profile.blocks,
        ops=ops,
        fingerprint=profile.fingerprint,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_extra_ms=sim.extra_ms,
        baseline_peak_bytes=profile.peak_bytes,
        baseline_step_ms=profile.step_ms,
    )


def plan(
    profile: Profile,
    budget: int | str | Budget | None = None,
    *,
    solver: str = "optimal",
    strategy: Strategy | None = None,
) -> Plan:
    """The fastest plan whose predicted peak fits ``budget`` (or a strategy's plan, with predictions).

    Under an initialised ``torch.distributed`` process group with several ranks this is a collective:
    every rank must call it; the ranks' profiles are merged (the largest bytes and times of any rank),
    and every rank returns rank 0's plan (NOTE [ One plan for every rank ] in ``remat.plan.ranks``).

    Args:
        profile: From ``remat.profile``.
        budget: Bytes (an int or ``"1.5GiB"``) or a share of the unplanned peak (``"40%"``): the same
            quantity ``remat.measure`` reports, the peak of a step above the memory held before it.
        solver: ``"optimal"`` (exact chain DP with nested recomputation) or ``"knapsack"`` (the best
            single level of individually checkpointed blocks).
        strategy: Instead of a solver, a rule-of-thumb strategy (``remat.every_nth(2)`` ...), turned into a
            plan on this profile so it can be compared on predicted figures.

    Returns:
        The :class:`Plan`, with predicted peak and recompute time.

    Raises:
        BudgetInfeasibleError: If no plan fits; the message states the smallest feasible peak.
        RematError: For an unknown solver or a missing budget.
        PlanMismatchError: Under a process group, if the ranks profiled different blocks.
    """
    from remat.plan.ranks import one_plan  # local: remat.distributed imports the plan types

    return one_plan(profile, lambda prof: _plan_here(prof, budget, solver=solver, strategy=strategy))


def _plan_here(profile: Profile, budget: int | str | Budget | None, *, solver: str, strategy: Strategy | None) -> Plan:
    """``plan`` on this process alone."""
    if strategy is not None:
        if budget is not None:
            raise RematError("plan: give a budget (for a solver) or a strategy, not both")
        return plan_from_ops(profile, strategy.ops(profile.blocks, profile), strategy.label)
    if solver not in SOLVERS:
        raise RematError(
            f"plan: unknown solver {solver!r}; valid solvers are {', '.join(SOLVERS)} "
            f"(or pass strategy=... for one of {', '.join(STRATEGIES)})"
        )
    if budget is None:
        raise RematError("plan: a budget is needed, in bytes ('1.5GiB') or as a share of the unplanned peak ('40%')")
    budget_bytes = parse_budget(budget).resolve(profile.peak_bytes)
    chain = chain_of(profile)
    nested = solver == "optimal" and _nested(profile)
    headroom = budget_bytes - chain.base_bytes
    fixed = max(chain.pre_peak_bytes, chain.base_bytes + chain.tail_peak_bytes)
    ops: tuple[Op, ...] | None = None
    keep_all = tuple(Keep(i) for i in range(chain.n))
    if simulate(chain, keep_all).peak_bytes <= budget_bytes:
        ops = keep_all  # nothing to recompute: no solver can do better
    elif fixed <= budget_bytes and headroom >= 0:
        ops = SOLVERS[solver](profile, chain, headroom)
    subs = profile.sub_costs() if solver == "optimal" else None
    smallest = min_peak(chain, nested=nested, sub_costs=subs)
    if ops is None and smallest <= budget_bytes:
        # Memory is discretised on the safe side (NOTE [ Rotor dynamic program ]), so a budget within
        # a few units of the smallest peak can be missed: solve finer, else take the lowest-peak plan.
        ops = solve(chain, headroom, nested=nested, slots=min(1 << 16, max(1, headroom)), sub_costs=subs) or (
            min_peak_plan(chain, nested=nested, sub_costs=subs)
        )
        log.info(
            "plan: budget %s is within rounding of the smallest peak; used a finer solve", format_bytes(budget_bytes)
        )
    if ops is None:
        cheapest = ops_repr(min_peak_plan(chain, nested=nested, sub_costs=subs))
        raise BudgetInfeasibleError(
            f"plan: budget {format_bytes(budget_bytes)} is below the smallest feasible peak {format_bytes(smallest)} "
            f"({solver}: {cheapest}); raise the budget or lower the batch size",
            budget_bytes=budget_bytes,
            min_peak_bytes=smallest,
        )
    label = solver if nested or solver == "knapsack" else f"{solver} (single-level: blocks are not a chain)"
    return plan_from_ops(profile, ops, label, budget_bytes)
