"""The one-line forms of the public API: ``remat.apply(model, remat.full())`` plans, then applies.

The apply and measure stages take a :class:`~remat.plan.types.Plan` only (one input per verb). These
wrappers, exported as ``remat.apply`` and ``remat.check_gradients``, also take a strategy: they turn
it into a plan first (``remat.plan.planner.to_plan``) and hand that to the stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from remat.apply import apply as apply_plan
from remat.blocks import Block
from remat.errors import RematError
from remat.measure import GradientCheck
from remat.measure import check_gradients as check_plan
from remat.plan.planner import to_plan
from remat.plan.strategies import STRATEGIES, Strategy
from remat.plan.types import Plan
from remat.profile.types import Profile
from remat.units import parse_budget

__all__ = ["apply", "check_gradients"]


def _as_plan(
    where: str, plan: Plan | Strategy, model: nn.Module, blocks: Sequence[Block] | None, profile: Profile | None
) -> Plan:
    """``plan`` itself, or the strategy's plan on ``model`` (on ``blocks``, with ``profile``'s figures)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Strategy):
        return to_plan(plan, model, blocks=blocks, profile=profile)
    raise RematError(f"{where}: expected a Plan or a strategy, got {type(plan).__name__} {plan!r}; {_hint(plan)}")


def _hint(plan: object) -> str:
    """How to turn ``plan`` (neither a Plan nor a strategy) into a plan: a budget is solved on a profile."""
    if not isinstance(plan, str):
        return "give remat.plan(...)'s result or a strategy such as remat.full()"
    if plan.strip().partition("(")[0].strip() in STRATEGIES:
        return f"plan the strategy first: remat.plan(model, strategy={plan!r}), or pass the strategy object (remat.full() ...)"
    try:
        parse_budget(plan)
    except RematError:
        return f"give remat.plan(...)'s result or a strategy (one of {', '.join(STRATEGIES)})"
    return (
        f"{plan!r} is a memory budget, which needs measured sizes: profile, then plan for it: "
        f"remat.plan(remat.profile(model, inputs, loss_fn), budget={plan!r})"
    )


def apply(
    model: nn.Module,
    plan: Plan | Strategy,
    *,
    blocks: Sequence[Block] | None = None,
    profile: Profile | None = None,
    allow_stateful: bool = False,
    allow_saved_tensor_hooks: bool = False,
) -> Plan:
    """Checkpoint ``model`` in place according to a plan or a strategy.

    Each recomputed segment drops what autograd saves inside its blocks and, in the backward, replays
    the calls the model made to them (NOTE [ Spans ] in ``remat.core.runtime``). Parameters, their
    identity and ``state_dict`` keys are unchanged. Applying again replaces the previous plan;
    ``remat.remove`` restores the model exactly. A strategy is planned first, on ``blocks`` (default
    ``remat.blocks(model)``), then applied as a plan (``apply`` of the ``remat.apply`` module).

    Args:
        model: The model to change in place.
        plan: A :class:`~remat.plan.types.Plan` (from ``remat.plan``) or a strategy (``remat.full()`` ...).
        blocks: For a strategy, the blocks it chooses from (default ``remat.blocks(model)``).
        profile: For a strategy that needs sizes (``largest``, ``budget``, ``dynamic``); with a profile
            the plan carries predicted figures.
        allow_stateful: Recompute blocks whose forward updates buffers other than BatchNorm's (a
            stateful forward); by default the first such forward raises a ``RematError`` and leaves
            the model's state as it was (NOTE [ State under recomputation ]).
        allow_saved_tensor_hooks: Recompute blocks whose forward runs under saved-tensor hooks of your own
            that give back exactly what they are given (activation offloading); by default a RematError
            (NOTE [ Saved-tensor hooks around the forward ] in ``remat.core.runtime``).

    Returns:
        The plan now in effect.

    Raises:
        PlanMismatchError: If the plan was made for different blocks than this model has, or covers only
            part of them.
        RematError: If the plan's operations do not cover its blocks once each, in order, a strategy
            needs a profile and none is given, or ``plan`` is neither a Plan nor a strategy.
    """
    return apply_plan(
        model,
        _as_plan("apply", plan, model, blocks, profile),
        allow_stateful=allow_stateful,
        allow_saved_tensor_hooks=allow_saved_tensor_hooks,
    )


def check_gradients(
    model: nn.Module,
    plan: Plan | Strategy,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    exact: bool | None = None,
    profile: Profile | None = None,
    atol: float = 1e-6,
    allow_stateful: bool = False,
) -> GradientCheck:
    """Compare every parameter and input gradient of the plain model with the checkpointed one.

    Both runs start from the same RNG state, so dropout draws the same masks; the model is left as it
    was (any plan applied before is put back). A strategy is planned first (see :func:`apply`). When
    the gradients differ, a second plain step tells whether the model differs from itself
    (``GradientCheck.plain_repeatable``).

    Args:
        model: The model.
        plan: The plan or strategy to check.
        inputs: A tensor, tuple or dict; leaf tensors that require grad get their gradient compared.
        loss_fn: Maps the model's output to a scalar loss.
        exact: Bitwise comparison (default: on CPU yes, on CUDA no, where kernels may differ run to run).
        profile: For strategies that need sizes.
        atol: Tolerance when not exact.
        allow_stateful: Passed to :func:`apply`: recompute blocks that update buffers, restoring them.

    Returns:
        The :class:`remat.GradientCheck`.
    """
    return check_plan(
        model,
        _as_plan("check_gradients", plan, model, None, profile),
        inputs,
        loss_fn,
        exact=exact,
        atol=atol,
        allow_stateful=allow_stateful,
    )
