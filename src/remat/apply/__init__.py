"""Turning a plan into a checkpointed model, in place, and back.

This stage takes a :class:`~remat.plan.types.Plan` only: ``remat.plan(...)`` makes one from a profile,
blocks or a model, and the public ``remat.apply(model, remat.full())`` plans a strategy first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from remat.blocks import blocks as find_blocks
from remat.blocks import fingerprint, param_modules, resolve
from remat.core.ops import Keep, Op, Recompute, validate_ops
from remat.core.runtime import InputSizes, Trainable, attach, attached, detach, hook_watch, run_function
from remat.core.wrapped import unwrap
from remat.errors import BlockSelectionError, PlanMismatchError, RematError
from remat.plan.types import Plan

__all__ = ["apply", "remove", "applied", "checkpoint", "CheckpointedSequential"]


def apply(
    model: nn.Module, plan: Plan, *, allow_stateful: bool = False, allow_saved_tensor_hooks: bool = False
) -> Plan:
    """Checkpoint ``model`` in place according to a plan.

    Each recomputed segment drops what autograd saves inside its blocks and, in the backward, replays
    the calls the model made to them (RNG, autocast and buffer state restored per call, nested for
    nested plans; NOTE [ Spans ] in ``remat.core.runtime``). Every block still runs when the model
    calls it and returns its real output, whatever the calling pattern. Parameters, their identity and
    ``state_dict`` keys are unchanged. Applying again replaces the previous plan; :func:`remove`
    restores the model exactly.

    Args:
        model: The model to change in place.
        plan: A :class:`~remat.plan.types.Plan`, from ``remat.plan`` (or ``Plan.from_json``). For a
            strategy, plan it first (``remat.plan(model, strategy=remat.full())``) or call the public
            ``remat.apply(model, remat.full())``, which does.
        allow_stateful: Recompute blocks whose forward updates buffers other than BatchNorm's (a
            stateful forward); by default the first such forward raises a ``RematError`` and leaves
            the model's state as it was (NOTE [ State under recomputation ]).
        allow_saved_tensor_hooks: Recompute blocks whose forward runs under saved-tensor hooks of your own
            that give back exactly what they are given (activation offloading): the recomputed blocks
            bypass them, as under ``torch.utils.checkpoint``. By default such a forward raises a
            ``RematError``, as lossy hooks (compression) would make the gradients differ; torch's
            ``save_on_cpu`` is allowed without it (NOTE [ Saved-tensor hooks around the forward ]).

    A plan made from a profile is for the profiled batch: the first call of a block that takes more input
    bytes than there warns (``RematWarning``, once per applied plan), as the step can then peak above the
    plan's budget (NOTE [ Batches larger than the profiled one ] in ``remat.core.runtime``).

    Returns:
        The plan now in effect.

    Raises:
        PlanMismatchError: If the plan was made for different blocks than this model has, or covers only
            part of them (a plan for a 4-layer model on a 6-layer one).
        RematError: If ``plan`` is not a Plan, or its operations do not cover its blocks once each, in
            order (``remat.core.ops.validate_ops``).
    """
    if not isinstance(plan, Plan):
        raise RematError(
            f"apply: expected a Plan, got {type(plan).__name__}; make one with remat.plan(model, strategy=...) "
            "or remat.plan(profile, budget), or call remat.apply(model, strategy), which plans it first"
        )
    validate_ops(
        plan.ops, len(plan.blocks), block_fqns=[b.fqns for b in plan.blocks], source=f"apply ({plan.strategy})"
    )
    _refuse_hf_checkpointing(model, plan)
    try:
        members = resolve(model, plan.blocks)
    except BlockSelectionError as e:
        if unwrap(model) is not model:
            # A plan made on the model a DDP wrapper holds (NOTE [ Wrapped models ] in remat.core.wrapped).
            return apply(
                unwrap(model), plan, allow_stateful=allow_stateful, allow_saved_tensor_hooks=allow_saved_tensor_hooks
            )
        # The selection's own fix ("select blocks on this model") is not the user's: the plan is for another model.
        what = str(e).removeprefix("blocks: ").split("; ")[0]
        raise PlanMismatchError(
            f"apply: the plan ({plan.strategy}) does not fit this model: {what}; the plan was made for another "
            f"model (blocks {plan.blocks[0].name}..{plan.blocks[-1].name}): profile and plan this model again"
        ) from None
    _refuse_inplace_starts(plan, members)
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
    # NOTE [ Batches larger than the profiled one ] in remat.core.runtime: a plan from a profile is for its batch.
    sizes = (
        InputSizes(plan.input_bytes, plan.strategy, plan.budget_bytes, plan.predicted_peak_bytes, model)
        if plan.input_bytes is not None and len(plan.input_bytes) == len(plan.blocks)
        else None
    )
    # NOTE [ Parameters unfrozen after planning ] in remat.blocks: and for the parameters requiring grad then.
    trainable = (
        Trainable(
            plan.trainable_params,
            param_modules(model, members),
            tuple(b.fqns[0] for b in plan.blocks),
            plan.strategy,
            plan.budget_bytes,
            plan.predicted_peak_bytes,
        )
        if plan.trainable_params is not None and len(plan.trainable_params) == len(plan.blocks) + 1
        else None
    )
    attach(
        model,
        plan,
        plan.ops,
        members,
        [b.fqns for b in plan.blocks],
        allow_stateful=allow_stateful,
        allow_hooks=allow_saved_tensor_hooks,
        sizes=sizes,
        trainable=trainable,
        hooks=hook_watch(model, plan.strategy, plan.budget_bytes, plan.predicted_peak_bytes),
    )
    return plan


def _starts(ops: tuple[Op, ...]) -> list[int]:
    """The first block of every segment of ``ops``, nested ones included."""
    out = []
    for op in ops:
        if isinstance(op, Recompute):
            out.append(op.start)
            out.extend(_starts(op.inner))
    return out


def _edits_input(m: nn.Module) -> bool:
    """Whether ``m`` is a torch module built with ``inplace=True`` that edits its input (``nn.ReLU(inplace=True)``;
    a dropout with ``p > 0`` in training mode); ``remat.plan.strategies.inplace_blocks`` reads the same."""
    return (
        getattr(m, "inplace", False) is True
        and type(m).__module__.startswith("torch.nn.modules.")
        and ("dropout" not in type(m).__module__ or (m.training and getattr(m, "p", 1) > 0))
    )


def _refuse_inplace_starts(plan: Plan, members: list[list[nn.Module]]) -> None:
    """A RematError, before anything runs, if a segment starts at a block whose first member is a torch
    module built with ``inplace=True`` (``nn.ReLU(inplace=True)``; a dropout with ``p > 0`` in training mode): its replay
    would edit the segment's input again, which the first step would refuse (NOTE [ In-place edits of a
    member's output ] in ``remat.core.runtime``). Plans from a profile or a model never do; a strategy
    planned on bare blocks (``remat.plan(blocks, strategy=...)``) cannot know."""
    for i in _starts(plan.ops):
        m = members[i][0]
        if _edits_input(m):
            b = plan.blocks[i]
            raise RematError(
                f"apply: the plan ({plan.strategy}) starts a segment at block {i} ({b.name}, {type(m).__name__}"
                "(inplace=True)), which edits its input in place, so its recomputation would edit it again; plan "
                "on the model or a profile (remat.plan(model, strategy=...), remat.apply(model, strategy, "
                "blocks=...)), which put it in the segment of the block before it, or keep it"
            )


def _refuse_hf_checkpointing(model: nn.Module, plan: Plan) -> None:
    """A RematError if HF's own checkpointing is on and the plan recomputes anything: each layer would
    be recomputed by HF inside remat's replays too (three forwards, for memory HF's alone gives)."""
    if all(isinstance(op, Keep) for op in plan.ops):
        return
    inner = unwrap(model)
    on = [name for name, m in inner.named_modules() if getattr(m, "gradient_checkpointing", None) is True]
    if on or getattr(inner, "is_activation_checkpointing", None) is True:
        where = f" (modules {on[:3]})" if on else ""
        raise RematError(
            f"apply: HF's own checkpointing is on{where} (gradient_checkpointing_enable() or TrainingArguments("
            "gradient_checkpointing=True)), so the layers would be recomputed by HF inside remat's recomputation "
            "too; call model.gradient_checkpointing_disable() before remat.apply (remat.hf.enable plans instead of it)"
        )


def remove(model: nn.Module) -> Plan | None:
    """Undo :func:`apply`: every module gets its original ``forward`` back.

    Args:
        model: The model a plan was applied to (or the DDP wrapper around it).

    Returns:
        The plan that was removed, or ``None`` if none was applied.
    """
    return detach(model)


def applied(model: nn.Module) -> Plan | None:
    """The plan currently applied to ``model`` (or to the module a DDP wrapper holds), if any.

    Args:
        model: The model, or the DDP wrapper around it.

    Returns:
        The plan :func:`apply` put in effect, or ``None`` if none is applied.
    """
    entry = attached(model)
    return entry.tag if entry is not None else None


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` so that its activations are dropped after the forward and recomputed in
    the backward (RNG state preserved, so dropout is exact).

    Buffers that ``fn`` updates in place (BatchNorm running statistics) end as in a plain call when
    ``fn`` is a module, a bound method of one, or a function that closes over the modules it uses
    (NOTE [ State under recomputation ] in ``remat.core.runtime``). The function-level form of the
    toolkit seed's ``checkpoint(fn, x)``.

    Args:
        fn: The function or module to run.
        *args: Its positional arguments (tensors that need gradients flow through).
        **kwargs: Its keyword arguments.

    Returns:
        What ``fn(*args, **kwargs)`` returns.
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
        blocks = find_blocks(self, named=[[n] for n, _ in self.named_children()])
        ops = _segment_ops(len(blocks), segments)
        if any(isinstance(op, Recompute) and _edits_input(self[op.start]) for op in ops):
            # A cut before a child built with inplace=True moves after it, as remat.segments(k) on the model
            # does (NOTE [ Strategies and in-place blocks ] in remat.plan.strategies; local: the plan stage).
            from remat.plan.strategies import Target, _fit, inplace_blocks

            ops = _fit(Target(blocks, inplace=inplace_blocks(self, blocks)), ops)
        apply(self, Plan(f"segments(k={segments})", blocks, ops, fingerprint=fingerprint(self, blocks)))


def _segment_ops(n: int, k: int) -> tuple[Op, ...]:
    # remat.segments(k)'s operations (the apply stage reads no strategies; tests/apply pins the two equal):
    # k even segments, the first n % k one block longer, every segment but the last checkpointed.
    size, extra = divmod(n, k)
    ops: list[Op] = []
    start = 0
    for j in range(k):
        stop = start + size + (1 if j < extra else 0)
        keeps = tuple(Keep(i) for i in range(start, stop))
        ops.extend(keeps if j == k - 1 else (Recompute(start, stop, keeps),))
        start = stop
    return tuple(ops)
