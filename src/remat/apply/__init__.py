"""Turning a plan (or a strategy) into a checkpointed model, in place, and back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from remat.blocks import Block, fingerprint, resolve
from remat.blocks import blocks as find_blocks
from remat.core.ops import validate_ops
from remat.core.runtime import attach, attached, detach, run_function
from remat.core.wrapped import unwrap
from remat.errors import BlockSelectionError, PlanMismatchError, RematError
from remat.plan.strategies import Strategy, _Named
from remat.plan.types import Plan

if TYPE_CHECKING:
    from remat.profile.types import Profile

__all__ = ["apply", "remove", "applied", "checkpoint", "CheckpointedSequential", "to_plan"]


def to_plan(
    strategy: Strategy,
    model: nn.Module | None = None,
    *,
    blocks: Sequence[Block] | None = None,
    profile: Profile | None = None,
) -> Plan:
    """A strategy's plan over the given blocks (from ``blocks``, the profile, or ``remat.blocks(model)``).

    When a profile is given the plan carries predicted figures (see ``remat.plan``).
    """
    if isinstance(strategy, _Named):
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
    if profile is not None and not isinstance(strategy, _Named):
        from remat.plan.planner import plan_from_ops

        return plan_from_ops(profile, strategy.ops(block_list, profile), strategy.label)
    fp = fingerprint(model, block_list) if model is not None else None
    return Plan(
        strategy=strategy.label, blocks=tuple(block_list), ops=strategy.ops(block_list, profile), fingerprint=fp
    )


def apply(
    model: nn.Module,
    plan: Plan | Strategy,
    *,
    blocks: Sequence[Block] | None = None,
    profile: Profile | None = None,
    allow_stateful: bool = False,
) -> Plan:
    """Checkpoint ``model`` in place according to a plan or a strategy.

    Each recomputed segment drops what autograd saves inside its blocks and, in the backward, replays
    the calls the model made to them (RNG, autocast and buffer state restored per call, nested for
    nested plans; NOTE [ Spans ] in ``remat.core.runtime``). Every block still runs when the model
    calls it and returns its real output, whatever the calling pattern. Parameters, their identity and
    ``state_dict`` keys are unchanged. Applying again replaces the previous plan; :func:`remove`
    restores the model exactly.

    Args:
        model: The model to change in place.
        plan: A :class:`~remat.plan.types.Plan` (from ``remat.plan``) or a strategy (``remat.full()`` ...).
        blocks: For a strategy, the blocks it chooses from (default ``remat.blocks(model)``).
        profile: For a strategy that needs sizes (``largest``, ``budget``, ``dynamic``).
        allow_stateful: Recompute blocks whose forward updates buffers other than BatchNorm's (a
            stateful forward); by default the first such forward raises a ``RematError`` and leaves
            the model's state as it was (NOTE [ State under recomputation ]).

    Returns:
        The plan now in effect.

    Raises:
        PlanMismatchError: If the plan was made for different blocks than this model has, or covers only
            part of them (a plan for a 4-layer model on a 6-layer one).
        RematError: If the plan's operations do not cover its blocks once each, in order
            (``remat.plan.chain.validate_ops``), or a strategy needs a profile and none is given.
    """
    if isinstance(plan, Strategy):
        plan = to_plan(plan, model, blocks=blocks, profile=profile)
    elif not isinstance(plan, Plan):
        raise RematError(
            f"apply: expected a Plan or a strategy, got {type(plan).__name__}; see remat.plan or remat.full()"
        )
    validate_ops(
        plan.ops, len(plan.blocks), block_fqns=[b.fqns for b in plan.blocks], source=f"apply ({plan.strategy})"
    )
    try:
        members = resolve(model, plan.blocks)
    except BlockSelectionError as e:
        if unwrap(model) is not model:
            # A plan made on the model a DDP wrapper holds (NOTE [ Wrapped models ] in remat.core.wrapped).
            return apply(unwrap(model), plan, allow_stateful=allow_stateful)
        raise PlanMismatchError(f"apply: the plan ({plan.strategy}) does not fit this model: {e}") from None
    if plan.fingerprint is not None:
        # "<blocks>.<run>" (remat.blocks.fingerprint); a plan written before <run> existed has only <blocks>.
        want_blocks, _, want_run = plan.fingerprint.partition(".")
        found_blocks, _, found_run = fingerprint(model, plan.blocks).partition(".")
        if found_blocks != want_blocks:
            raise PlanMismatchError(
                f"apply: the plan ({plan.strategy}) was made for blocks with fingerprint {want_blocks}, but this "
                f"model's blocks {plan.blocks[0].name}..{plan.blocks[-1].name} give {found_blocks} (different classes or "
                "parameter shapes); profile and plan this model again"
            )
        if want_run and found_run != want_run:
            try:
                here = find_blocks(model)
                found = f"here remat.blocks(model) finds {len(here)} blocks ({here[0].name}..{here[-1].name})"
            except BlockSelectionError:
                found = "here remat.blocks(model) finds no blocks"
            raise PlanMismatchError(
                f"apply: the plan ({plan.strategy}) covers {len(plan.blocks)} blocks ({plan.blocks[0].name}.."
                f"{plan.blocks[-1].name}) of a model with a different number of such modules; {found}; a plan "
                "must cover the blocks of the model it was made for, not part of them: profile and plan this model again"
            )
    attach(model, plan, plan.ops, members, [b.fqns for b in plan.blocks], allow_stateful=allow_stateful)
    return plan


def remove(model: nn.Module) -> Plan | None:
    """Undo :func:`apply`: every module gets its original ``forward`` back.

    Returns:
        The plan that was removed, or ``None`` if none was applied.
    """
    return detach(model)


def applied(model: nn.Module) -> Plan | None:
    """The plan currently applied to ``model`` (or to the module a DDP wrapper holds), if any."""
    entry = attached(model)
    return entry.tag if entry is not None else None


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` so that its activations are dropped after the forward and recomputed in
    the backward (RNG state preserved, so dropout is exact).

    Buffers that ``fn`` updates in place (BatchNorm running statistics) end as in a plain call when
    ``fn`` is a module, a bound method of one, or a function that closes over the modules it uses
    (NOTE [ State under recomputation ] in ``remat.core.runtime``). The function-level form of the
    toolkit seed's ``checkpoint(fn, x)``.
    """
    return run_function(fn, args, kwargs)


class CheckpointedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose children are cut into ``segments`` even segments, all but the last
    checkpointed (``torch.utils.checkpoint.checkpoint_sequential``'s rule), through remat.

    Args:
        *layers: The modules, in order.
        segments: Number of segments, 1..len(layers).
    """

    def __init__(self, *layers: nn.Module, segments: int = 2) -> None:
        super().__init__(*layers)
        if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= max(1, len(layers)):
            raise RematError(
                f"CheckpointedSequential: segments={segments!r} must be in 1..{len(layers)} (the number of layers)"
            )
        self.segments = segments
        from remat.plan.strategies import segments as seg

        apply(self, seg(segments), blocks=find_blocks(self, named=[[n] for n, _ in self.named_children()]))
