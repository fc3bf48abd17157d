"""``remat.plan``: from a profile (or blocks, or a model) to a plan, by a solver under a budget or by a strategy."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from remat.blocks import Block, fingerprint
from remat.blocks import blocks as find_blocks
from remat.core.ops import Keep, Op, Recompute, RecomputeSub, ops_repr
from remat.errors import BudgetInfeasibleError, RematError
from remat.plan.chain import Chain, chain_of
from remat.plan.policies import op_costs
from remat.plan.solver import (
    SubCosts,
    VariantCost,
    VariantId,
    finest_slots,
    min_peak,
    min_peak_plan,
    simulate,
    solve,
)
from remat.plan.strategies import STRATEGIES, Named, Strategy, Target, inplace_blocks, parse_strategy
from remat.plan.types import Plan
from remat.profile.types import Profile
from remat.units import Budget, format_bytes, format_bytes_apart, parse_budget

__all__ = ["Solver", "SOLVERS", "plan", "plan_from_ops", "to_plan", "solver_named", "variant_costs"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Solver:
    """A way to find the fastest plan under a budget on a profile's chain (NOTE [ Rotor dynamic program ]).

    Attributes:
        name: Its key in :data:`SOLVERS`, and the ``strategy`` of the plans it makes.
        nests: Whether a segment may hold several blocks and nest further segments. The DP puts several
            blocks in one segment only across boundaries where the chain model holds (``Chain.joinable``),
            so nesting is always safe to allow.
        sub_variants: Whether a block may also be kept with its attention / FFN checkpointed
            (NOTE [ Keep variants ]).
        op_variants: Whether a block may also be kept under an op-level policy (``RecomputeOps``,
            NOTE [ Op-level policy costs ] in ``remat.profile.profiler``).
        top_level_variants: Whether sub-module variants stay out of segments (so that, without nesting,
            every operation of the plan compiles: NOTE [ Under torch.compile ] in ``remat.core.runtime``).
    """

    name: str
    nests: bool
    sub_variants: bool
    op_variants: bool = False
    top_level_variants: bool = False

    def sub_costs(self, profile: Profile) -> SubCosts | None:
        """The measured costs of the variants this solver may choose (``None``: it uses none)."""
        if not (self.sub_variants or self.op_variants):
            return None
        return variant_costs(profile, subs=self.sub_variants, ops=self.op_variants)

    def solve(
        self, profile: Profile, chain: Chain, headroom: int, *, slots: int | None = None
    ) -> tuple[Op, ...] | None:
        """The fastest operations whose peak fits ``headroom`` bytes above the chain's base (``None``: none fits).

        Args:
            profile: The profile ``chain`` was made from (for the sub-module costs).
            chain: ``chain_of(profile)``.
            headroom: Bytes available above ``chain.base_bytes``.
            slots: Memory discretisation of the DP (default: automatic).
        """
        return solve(
            chain,
            headroom,
            nested=self.nests,
            slots=slots,
            sub_costs=self.sub_costs(profile),
            top_level_variants=self.top_level_variants,
        )

    def min_peak(self, profile: Profile, chain: Chain) -> int:
        """The smallest peak any plan of this solver reaches, bytes: as the simulation gives it (the peak
        table's figure can be a few bytes lower where a segment joins boundaries with a small gap or a
        generator state inside it, which the simulation counts)."""
        costs = self.sub_costs(profile)
        lowest = min_peak(chain, nested=self.nests, sub_costs=costs, top_level_variants=self.top_level_variants)
        held = profile.sub_held_inputs() if self.sub_variants else None
        return max(lowest, simulate(chain, self.min_peak_plan(profile, chain), costs, held).peak_bytes)

    def min_peak_plan(self, profile: Profile, chain: Chain) -> tuple[Op, ...]:
        """The operations of :meth:`min_peak`'s plan."""
        return min_peak_plan(
            chain, nested=self.nests, sub_costs=self.sub_costs(profile), top_level_variants=self.top_level_variants
        )


SOLVERS: dict[str, Solver] = {
    s.name: s
    for s in (
        # exact chain DP: nested recomputation, sub-module variants, op-level policies
        Solver("optimal", nests=True, sub_variants=True, op_variants=True),
        # the best single level of single blocks
        Solver("knapsack", nests=False, sub_variants=False),
        # single blocks and sub-modules, each one torch checkpoint: torch.compile traces the plan whole
        Solver("compile", nests=False, sub_variants=True, top_level_variants=True),
    )
}


def solver_named(name: str, *, where: str = "plan") -> Solver:
    """The registered solver ``name``.

    Raises:
        RematError: If there is none; the message lists :data:`SOLVERS` (and the strategies, the alternative).
    """
    found = SOLVERS.get(name)
    if found is None:
        raise RematError(
            f"{where}: unknown solver {name!r}; valid solvers are {', '.join(SOLVERS)} "
            f"(or pass strategy=... for one of {', '.join(STRATEGIES)})"
        )
    return found


def variant_costs(profile: Profile, *, subs: bool = True, ops: bool = True) -> dict[tuple[int, VariantId], VariantCost]:
    """The measured costs of the ways of keeping a block other than plainly (NOTE [ Keep variants ]):
    sub-modules checkpointed (``subs``), op-level policies (``ops``)."""
    costs: dict[tuple[int, VariantId], VariantCost] = {}
    for (k, fqns), sub in (profile.sub_costs() if subs else {}).items():
        costs[(k, fqns)] = sub
    for (k, op), policy in (op_costs(profile) if ops else {}).items():
        costs[(k, op)] = policy
    return costs


def plan_from_ops(profile: Profile, ops: tuple[Op, ...], label: str, budget_bytes: int | None = None) -> Plan:
    """A plan for ``ops`` on ``profile``'s blocks, with its simulated peak and recompute time.

    Raises:
        RematError: If ``ops`` checkpoints a sub-module alone that the profile has no figures for.
    """
    costs = variant_costs(profile)
    for op in ops:
        if isinstance(op, RecomputeSub) and (op.index, tuple(op.fqns)) not in costs:
            raise RematError(
                f"plan: {label} checkpoints {', '.join(op.fqns)} alone, which the profile has no figures for: "
                "a sub-module that edits its input in place (Mixtral's router jitter) is never checkpointed "
                "alone, as apply would refuse it; keep that block or recompute it whole (another strategy, "
                "or a budget)"
            )
    sim = simulate(chain_of(profile), ops, costs, profile.sub_held_inputs())
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
        loop=profile.loop,
        input_bytes=tuple(bp.input_bytes for bp in profile.block_profiles),
        trainable_params=profile.trainable_params or None,
    )


def to_plan(
    strategy: Strategy,
    model: nn.Module | None = None,
    *,
    blocks: Sequence[Block] | None = None,
    profile: Profile | None = None,
) -> Plan:
    """A strategy's plan over the given blocks (from ``blocks``, the profile, or ``remat.blocks(model)``).

    A ``named`` strategy finds its own blocks in ``model``. With a profile the plan carries predicted
    figures (see :func:`plan`); with a model, the model's fingerprint.

    Raises:
        RematError: If the strategy needs sizes and no profile is given, ``named`` has no model, or
            nothing gives the blocks.
    """
    if isinstance(strategy, Named):
        if model is None:
            raise RematError("apply: strategy 'named' needs the model to look its blocks up")
        block_list: Sequence[Block] = find_blocks(model, named=strategy.groups)
    elif blocks is not None:
        block_list = blocks
    elif profile is not None:
        block_list = profile.blocks
    elif model is not None:
        block_list = find_blocks(model)
    else:
        raise RematError("plan: give the blocks, a profile or the model for a strategy")
    if strategy.needs_profile and profile is None:
        raise RematError(
            f"apply: strategy {strategy.name} needs measured block sizes; pass profile=remat.profile(model, inputs, loss_fn)"
        )
    # Without a profile, the model tells which blocks edit their input in place (NOTE [ Strategies and
    # in-place blocks ] in remat.plan.strategies); on bare blocks apply refuses such a plan up front.
    inplace = inplace_blocks(model, block_list) if model is not None and profile is None else None
    ops = strategy.ops(Target(tuple(block_list), profile, inplace))
    if profile is not None and not isinstance(strategy, Named):
        return plan_from_ops(profile, ops, strategy.label)
    fp = fingerprint(model, block_list) if model is not None else None
    return Plan(strategy=strategy.label, blocks=tuple(block_list), ops=ops, fingerprint=fp)


def plan(
    source: Profile | Sequence[Block] | nn.Module,
    budget: int | str | Budget | None = None,
    *,
    solver: str = "optimal",
    strategy: Strategy | str | None = None,
) -> Plan:
    """The fastest plan whose predicted peak fits ``budget``, or a strategy's plan.

    Budgets need measured sizes, so a solver plans on a :class:`~remat.profile.Profile`; a strategy plans
    on a profile (its plan then carries predicted figures, to compare on), on blocks, or on a model
    (its ``remat.blocks``; ``named`` finds its own blocks there, so it needs the model).

    Under an initialised ``torch.distributed`` process group with several ranks, planning on a profile
    is a collective: every rank must call it; the ranks' profiles are merged (the largest bytes and times
    of any rank), and every rank returns rank 0's plan (NOTE [ One plan for every rank ] in
    ``remat.plan.ranks``).

    Args:
        source: From ``remat.profile``; or blocks (``remat.blocks(model)``) or the model itself, for a
            strategy that reads no sizes.
        budget: Bytes (an int or ``"1.5GiB"``) or a share of the unplanned peak (``"40%"``): the same
            quantity ``remat.measure`` reports, the peak of a step above the memory held before it.
        solver: A name in :data:`SOLVERS`: ``"optimal"`` (exact chain DP with nested recomputation,
            sub-module variants and op-level policies), ``"knapsack"`` (the best single level of
            individually checkpointed blocks) or ``"compile"`` (single blocks and sub-modules, each one
            torch checkpoint, so torch.compile traces the planned model without graph breaks).
        strategy: Instead of a solver, a rule-of-thumb strategy: ``remat.every_nth(2)`` ..., or the same as
            text, as the command line's ``--strategy`` takes it (``"every_nth(2)"``, ``"full"``).

    Returns:
        The :class:`Plan`; on a profile, with predicted peak and recompute time.

    Raises:
        BudgetInfeasibleError: If no plan fits; the message states the smallest feasible peak.
        RematError: For an unknown solver or strategy, a missing budget, a budget or a sized strategy
            without a profile, or a source that is none of the above.
        PlanMismatchError: Under a process group, if the ranks profiled different blocks.
    """
    if isinstance(budget, Strategy) or (isinstance(budget, str) and _names_a_strategy(budget)):
        text = budget.label if isinstance(budget, Strategy) else budget.strip()
        raise RematError(
            f"plan: budget {budget!r} is a strategy, not a memory budget; did you mean strategy={text!r}? "
            f"e.g. remat.plan(source, strategy={text!r}); a budget is a share ('40%') or bytes ('1.5GiB')"
        )
    if budget is not None:
        budget = parse_budget(budget)  # its own mistakes first, whatever the source ("0.4": did you mean '40%'?)
    chosen = parse_strategy(strategy) if isinstance(strategy, str) else strategy
    if chosen is not None and not isinstance(chosen, Strategy):
        raise RematError(
            f"plan: strategy is a {type(chosen).__name__}; give a strategy (remat.every_nth(2) ...) or its text "
            "('every_nth(2)'); a Plan needs no planning"
        )
    if isinstance(source, Profile):
        from remat.plan.ranks import one_plan  # local: remat.plan.ranks imports the plan types

        return one_plan(source, lambda prof: _plan_here(prof, budget, solver=solver, strategy=chosen))
    what = _describe_source(source)
    if budget is not None and chosen is not None:
        raise RematError("plan: give a budget (for a solver) or a strategy, not both")
    if chosen is None:
        raise RematError(
            f"plan: a budget needs measured sizes, not in {what}; plan on a profile: "
            "remat.plan(remat.profile(model, inputs, loss_fn), budget), or give strategy=... (e.g. 'every_nth(2)')"
        )
    if chosen.needs_profile:
        raise RematError(
            f"plan: strategy {chosen.name} needs measured block sizes, not in {what}; pass a profile "
            "instead: remat.plan(remat.profile(model, inputs, loss_fn), strategy=...)"
        )
    if isinstance(source, nn.Module):
        return to_plan(chosen, source)
    if isinstance(chosen, Named):
        raise RematError(
            "plan: strategy named finds its blocks in the model; pass the model: "
            "remat.plan(model, strategy=remat.named(...))"
        )
    return to_plan(chosen, blocks=tuple(source))


def _names_a_strategy(text: str) -> bool:
    """Whether ``text`` starts with a registered strategy's name (``"full"``, ``"every_nth(2)"``)."""
    return text.strip().partition("(")[0].strip() in STRATEGIES


def _describe_source(source: object) -> str:
    """What a non-profile ``source`` is, in words; a RematError if it is neither blocks nor a module."""
    if isinstance(source, nn.Module):
        return f"the model ({type(source).__name__})"
    if isinstance(source, Sequence) and not isinstance(source, str) and all(isinstance(b, Block) for b in source):
        return f"the {len(source)} blocks"
    raise RematError(
        f"plan: source is a {type(source).__name__}; give a Profile (remat.profile(model, inputs, loss_fn)), "
        "blocks (remat.blocks(model)) or the model"
    )


_RESOLVES = 24  # solves at lowered budgets, at most, when a solver's plan is predicted above its budget


def _solved_below(profile: Profile, chain: Chain, chosen: Solver, headroom: int, over: int, budget: int) -> Plan | None:
    """The plan of ``chosen`` at the largest headroom below ``headroom`` whose plan fits ``budget``.

    Headroom is lowered by ``over``, doubling, until a plan fits; then bisected between the last
    headroom that did not fit and the first that did. None if no lowered headroom fits.
    """

    def fitting(h: int) -> Plan | None:
        ops = chosen.solve(profile, chain, h) if h >= 0 else None
        got = plan_from_ops(profile, ops, chosen.name, budget) if ops is not None else None
        return got if got is not None and (got.predicted_peak_bytes or 0) <= budget else None

    step, misses, hi, lo, best = over, 0, headroom, None, None
    while lo is None and misses < _RESOLVES and hi - step >= 0:
        misses += 1
        best = fitting(hi - step)
        if best is None:
            hi, step = hi - step, step * 2
        else:
            lo = hi - step
    while lo is not None and hi - lo > 1 and misses < _RESOLVES:
        misses += 1
        mid = (lo + hi) // 2
        got = fitting(mid)
        if got is None:
            hi = mid
        else:
            lo, best = mid, got
    return best


def _late_once(profile: Profile, chain: Chain, chosen: Solver, headroom: int, budget: int) -> tuple[Plan | None, Plan]:
    """A plan of ``chosen`` that fits ``budget`` by the simulation where its tables, which charge each late input
    (``Chain.late_inputs``: an attention mask, rotary tables, T5's bias, taken by every layer) to every
    checkpoint holding it, find none; ``None`` if there is none.

    The simulation charges such a tensor once, by the first checkpoint that holds it (NOTE [ Chain cost model ]):
    a plan checkpointing every layer holds one mask, while the tables charge one per checkpoint (remat's own
    ``full()`` plan, predicted and measured within a budget, was refused). So the solver is also asked on the
    chain with every late input held throughout instead (its bytes off the headroom, charged to no
    checkpoint), for its fastest plan there and its lowest-peak plan, and the single-block checkpoints of every
    block it may recompute; each is judged by the simulation of the real chain, and the fastest that fits wins.
    Returns it (``None``: none fits) and the one predicted lowest.
    """
    extra = sum(int(nbytes) for nbytes, *_ in chain.late_inputs if nbytes > 0)
    # Likewise the tensors the model's code holds past their saving taker (Chain.code_held_inputs): the tables
    # hold them to the segment's backward, the simulation only to where the code frees them (seed 56's
    # lowest-peak plan, predicted and measured 7870180, was above the tables' 8263396 one): the chain without
    # them proposes, the simulation of the real chain judges.
    once = dataclasses.replace(chain, late_inputs=(), code_held_inputs=())
    candidates: list[tuple[Op, ...]] = []
    solved = chosen.solve(profile, once, headroom - extra) if headroom - extra >= 0 else None
    if solved is not None:
        candidates.append(solved)
    candidates.append(chosen.min_peak_plan(profile, once))
    candidates.append(
        tuple(
            Recompute(k, k + 1, (Keep(k),)) if chain.recomputable[k] and chain.startable[k] else Keep(k)
            for k in range(chain.n)
        )
    )
    plans = [plan_from_ops(profile, ops, chosen.name, budget) for ops in dict.fromkeys(candidates)]
    fits = [p for p in plans if (p.predicted_peak_bytes or 0) <= budget]
    best = min(fits, key=lambda p: p.predicted_extra_ms or 0.0) if fits else None
    return best, min(plans, key=lambda p: p.predicted_peak_bytes or 0)


def _plan_here(profile: Profile, budget: int | str | Budget | None, *, solver: str, strategy: Strategy | None) -> Plan:
    """``plan`` on a profile, on this process alone."""
    if strategy is not None:
        if budget is not None:
            raise RematError("plan: give a budget (for a solver) or a strategy, not both")
        return plan_from_ops(profile, strategy.ops(Target(profile.blocks, profile)), strategy.label)
    chosen = solver_named(solver)
    if budget is None:
        raise RematError("plan: a budget is needed, in bytes ('1.5GiB') or as a share of the unplanned peak ('40%')")
    budget_bytes = parse_budget(budget).resolve(profile.peak_bytes)
    chain = chain_of(profile)
    headroom = budget_bytes - chain.base_bytes
    fixed = max(chain.pre_peak_bytes, chain.base_bytes + chain.tail_peak_bytes)
    ops: tuple[Op, ...] | None = None
    keep_all = tuple(Keep(i) for i in range(chain.n))
    if simulate(chain, keep_all).peak_bytes <= budget_bytes:
        ops = keep_all  # nothing to recompute: no solver can do better
    elif fixed <= budget_bytes and headroom >= 0:
        ops = chosen.solve(profile, chain, headroom)
    smallest = chosen.min_peak(profile, chain)
    if ops is None and smallest > budget_bytes:
        # The tables are never below the simulation, but may be above it (a late input held across
        # segments, NOTE [ Rotor dynamic program ]): the lowest-peak plan's own prediction decides.
        lowest = plan_from_ops(profile, chosen.min_peak_plan(profile, chain), chosen.name, budget_bytes)
        if lowest.predicted_peak_bytes is not None and lowest.predicted_peak_bytes < smallest:
            smallest = lowest.predicted_peak_bytes
            if smallest <= budget_bytes:
                ops = lowest.ops
                log.info("plan: the %s solver's tables are above its lowest-peak plan's prediction", chosen.name)
    cheapest_ops: tuple[Op, ...] | None = None
    if ops is None and smallest > budget_bytes and (chain.late_inputs or chain.code_held_inputs):
        # The tables charge a late input to every checkpoint holding it, the simulation once (_late_once).
        once, lowest_once = _late_once(profile, chain, chosen, headroom, budget_bytes)
        if once is not None:
            log.info(
                "plan: the %s solver's tables charge late inputs per checkpoint; a plan held once fits", chosen.name
            )
            return once
        if lowest_once.predicted_peak_bytes is not None and lowest_once.predicted_peak_bytes < smallest:
            # The error states the lowest peak a plan is predicted at, and that plan.
            smallest, cheapest_ops = lowest_once.predicted_peak_bytes, lowest_once.ops
    if ops is None and smallest > budget_bytes and fixed <= smallest:
        # NOTE [ The smallest peak an error states ]: the solver's own plan at the smallest peak can be
        # predicted lower than the lowest-peak plan (its tables are above the simulation by different
        # amounts per plan; solved as finely as a budget at it is): fuzz seed 804 was refused at
        # 320,000 B with "smallest feasible 322,496 B", and its plan at 322,496 B was predicted at
        # 319,760. That plan decides when it is lower.
        top = smallest - chain.base_bytes
        at_smallest = chosen.solve(profile, chain, top, slots=finest_slots(chain.n, top))
        if at_smallest is not None:
            found = plan_from_ops(profile, at_smallest, chosen.name, budget_bytes)
            if found.predicted_peak_bytes is not None and found.predicted_peak_bytes < smallest:
                if found.predicted_peak_bytes <= budget_bytes:
                    ops = at_smallest
                else:
                    smallest, cheapest_ops = found.predicted_peak_bytes, at_smallest
    if ops is None and smallest <= budget_bytes:
        # Memory is discretised on the safe side (NOTE [ Rotor dynamic program ]), so a budget within
        # a few units of the smallest peak can be missed: solve finer, else take the lowest-peak plan.
        ops = chosen.solve(profile, chain, headroom, slots=finest_slots(chain.n, headroom)) or chosen.min_peak_plan(
            profile, chain
        )
        log.info(
            "plan: budget %s is within rounding of the smallest peak; used a finer solve", format_bytes(budget_bytes)
        )
    if ops is None:
        cheapest = ops_repr(cheapest_ops or chosen.min_peak_plan(profile, chain))
        # Few coarse blocks (a VGG's features, pool and classifier) leave nothing to recompute that lowers
        # the peak: finer blocks do, inside the block that saves the most (named, not a fixed example).
        largest = max(zip(profile.blocks, profile.block_profiles), key=lambda bb: bb[1].saved_bytes)[0].name
        finer = (
            "; with these few blocks no plan lowers the peak much: profile finer blocks, "
            f"remat.blocks(model, split=True) or include=['{largest}.*']"
            if len(profile.blocks) <= 4 and smallest >= 0.9 * profile.peak_bytes
            else ""
        )
        stateful = [(b.name, bp.stateful) for b, bp in zip(profile.blocks, profile.block_profiles) if bp.stateful]
        if stateful:
            # Kept whatever the budget: say why, rather than suggesting finer blocks.
            names = ", ".join(name for name, _ in stateful[:3]) + (
                f" and {len(stateful) - 3} more" if len(stateful) > 3 else ""
            )
            what = ", ".join(dict.fromkeys(s for _, st in stateful for s in st))
            finer = (
                f"; {len(stateful)} of {len(profile.blocks)} blocks ({names}) are never recomputed whole: their "
                f"forward changes state ({what}; NOTE [ State under recomputation ])"
                + (
                    ": a KV cache passed to the layers (use_cache=True, or PEFT prefix tuning's past_key_values) is "
                    "appended to by each call, so train with use_cache=False and without prefix tuning to plan below this"
                    if any("Cache" in s for _, st in stateful for s in st)
                    else ""
                )
            )
        budget_text, smallest_text = format_bytes_apart(budget_bytes, smallest)  # NOTE [ Sizes a message compares ]
        raise BudgetInfeasibleError(
            f"plan: budget {budget_text} is below the smallest feasible peak {smallest_text} "
            f"({chosen.name}: {cheapest}); raise the budget or lower the batch size{finer}",
            budget_bytes=budget_bytes,
            min_peak_bytes=smallest,
        )
    chosen_plan = plan_from_ops(profile, ops, chosen.name, budget_bytes)
    over = (chosen_plan.predicted_peak_bytes or 0) - budget_bytes
    if over > 0:
        # The solvers' tables round on the safe side of the simulation (tests: brute force on chains);
        # should a variant's costs ever make them disagree (by bytes, NOTE [ Rotor dynamic program ]),
        # solve again for lower budgets before settling for the lowest-peak plan.
        below = _solved_below(profile, chain, chosen, headroom, over, budget_bytes)
        log.info(
            "plan: the %s solver's plan is predicted %s above the budget; %s",
            chosen.name,
            format_bytes(over),
            "solved again for a lower budget" if below is not None else "no lower budget's plan fits",
        )
        chosen_plan = below or chosen_plan
    if chosen_plan.predicted_peak_bytes is not None and chosen_plan.predicted_peak_bytes > budget_bytes:
        # No plan predicted above its budget is returned.
        lowest = plan_from_ops(profile, chosen.min_peak_plan(profile, chain), chosen.name, budget_bytes)
        log.warning(
            "plan: the %s solver's plan is predicted at %s, above the budget %s; checking its lowest-peak plan",
            chosen.name,
            format_bytes(chosen_plan.predicted_peak_bytes),
            format_bytes(budget_bytes),
        )
        if lowest.predicted_peak_bytes is not None and lowest.predicted_peak_bytes <= budget_bytes:
            return _held_once(profile, chain, chosen, headroom, budget_bytes, lowest)
        least = min(chosen_plan.predicted_peak_bytes, lowest.predicted_peak_bytes or chosen_plan.predicted_peak_bytes)
        budget_text, least_text = format_bytes_apart(budget_bytes, least)  # NOTE [ Sizes a message compares ]
        raise BudgetInfeasibleError(
            f"plan: budget {budget_text} is below the smallest peak {least_text} of a plan "
            f"the {chosen.name} solver finds ({ops_repr(lowest.ops)}); raise the budget or lower the batch size",
            budget_bytes=budget_bytes,
            min_peak_bytes=least,
        )
    return _held_once(profile, chain, chosen, headroom, budget_bytes, chosen_plan)


# NOTE [ Tables without the tensors held once ]
# The tables hold a late input (NOTE [ Late inputs made inside a segment ] in ``remat.plan.chain``) and a tensor
# the model's code holds past its saving taker (``Chain.code_held_inputs``) from a checkpoint's end to its
# backward, for every segment that could end there (``_held`` in ``remat.plan.solver``); the simulation holds
# each once, and only to where the code frees it. ``_late_once`` lets the chain without them propose only when
# the tables find no plan at all; a plan they do find can be much slower than one they reject: on workload B
# split into its 24 modules (``nn.Sequential`` of ``nn.Sequential``s, whose outer frame holds each inner
# stack's output through the next stack's call), every segment ending with a Linear, the cheap ones (the
# replay stops before its matmul), was charged its LayerNorm input to the backward, 4-16 MiB each; at 50% the
# tables' plan recomputed 547 ms per step (simulated peak 0.492 of none's), the chain without them proposed
# one at 392 ms (simulated 0.497, measured alike). So that chain always proposes too, at the headroom less the
# late inputs (held throughout, as ``_late_once``), lowered by the excess while its plan does not fit (a few
# solves at most); the simulation of the real chain judges, and the faster plan that fits wins. Both are
# predicted by the simulation, so the budget guarantee is the simulation's as before.
_HELD_ONCE_TRIES = 3


def _held_once(profile: Profile, chain: Chain, chosen: Solver, headroom: int, budget: int, current: Plan) -> Plan:
    """``current``, or a faster plan that the chain without its held-once tensors proposes and that fits ``budget``
    by the simulation (NOTE [ Tables without the tensors held once ])."""
    if not (chain.late_inputs or chain.code_held_inputs) or not current.predicted_extra_ms:
        return current
    once = dataclasses.replace(chain, late_inputs=(), code_held_inputs=())
    h = headroom - sum(int(nbytes) for nbytes, *_ in chain.late_inputs if nbytes > 0)
    for _ in range(_HELD_ONCE_TRIES):
        ops = chosen.solve(profile, once, h) if h >= 0 else None
        if ops is None or ops == current.ops:
            return current
        got = plan_from_ops(profile, ops, chosen.name, budget)
        if got.predicted_peak_bytes is None or got.predicted_extra_ms is None:
            return current
        if got.predicted_peak_bytes <= budget:
            return got if got.predicted_extra_ms < current.predicted_extra_ms else current
        h -= got.predicted_peak_bytes - budget
    return current
