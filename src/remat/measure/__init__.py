"""Measuring what really happens: peak memory, step time, recompute counts, gradient equality."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from remat._json import Reader, read
from remat._progress import progress as show_progress
from remat.apply import applied, apply, remove
from remat.blocks import Block, resolve
from remat.blocks import blocks as find_blocks
from remat.core.runtime import GeneratorWatch, count_forwards
from remat.core.trace import (
    Grads,
    Loop,
    MemoryTrace,
    OptimizerLike,
    device_of,
    iteration,
    median,
    preserved,
    record_memory,
    timed_steps,
    train_step,
)
from remat.errors import BlockSelectionError, RematError, higher_order_refused
from remat.plan.types import Plan

__all__ = ["Measurement", "GradientCheck", "measure", "check_gradients", "MemoryTrace", "Grads", "Loop"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measurement:
    """What an iteration of the training loop really cost (see NOTE [ What a step's peak means ] in
    ``remat.core.trace``).

    Attributes:
        peak_bytes: Peak of an iteration above the memory held before it, bytes (``loop.describe()``
            says which iteration, in words).
        step_ms: Median iteration time (forward + backward + the optimizer's step), milliseconds.
        step_ms_all: Every timed iteration, milliseconds.
        forward_counts: How many times each block's forward ran in one step (2 = recomputed once).
        held_bytes: Memory held before the iteration (parameters, buffers, inputs, optimizer state, and
            gradients when held), bytes.
        device: ``"cpu"`` or ``"cuda"``.
        plan: The label of the plan applied while measuring (``"none"`` if nothing was applied).
        loop: The iteration measured (files written before loops existed measured ``grads="held"``).
    """

    schema_version: ClassVar[int] = 1

    peak_bytes: int
    step_ms: float
    step_ms_all: tuple[float, ...]
    forward_counts: dict[str, int]
    held_bytes: int
    device: str
    plan: str
    loop: Loop = Loop(Grads.HELD)

    def to_json(self) -> str:
        """Serialise to a JSON string (with ``schema_version``)."""
        return json.dumps({"schema_version": self.schema_version, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Measurement:
        """Read a measurement written by :meth:`to_json` (NOTE [ One loading policy ] in ``remat._json``).

        Raises:
            RematError: If the text is not a measurement of this schema version, or lacks or mistypes a field.
        """
        return read(
            cls,
            text,
            Reader(
                "measure", "measure again with remat.measure(...).to_json() or `remat measure MODEL --out measure.json`"
            ),
        )


def _count_blocks(model: nn.Module, blocks: Sequence[Block] | None) -> tuple[Block, ...]:
    if blocks is not None:
        return tuple(blocks)
    plan = applied(model)
    if plan is not None:
        return plan.blocks
    try:
        return find_blocks(model)
    except BlockSelectionError:
        return ()


def measure(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    steps: int = 5,
    warmup: int = 1,
    blocks: Sequence[Block] | None = None,
    grads: Grads | str = Grads.NONE,
    optimizer: OptimizerLike | None = None,
    progress: bool | None = None,
) -> Measurement:
    """Run real iterations of the training loop on the model as it is (checkpointed or not) and measure them.

    Args:
        model: The model (with or without a remat plan applied).
        inputs: A tensor, a tuple of positional arguments or a dict of keyword arguments.
        loss_fn: Maps the model's output to a scalar loss.
        steps: Timed iterations, >= 1 (the median is reported).
        warmup: Untimed iterations first, >= 1 (they create the optimizer's state).
        blocks: Blocks whose forward runs to count (default: the applied plan's, else ``remat.blocks``).
        grads: ``"none"`` (gradients set to ``None`` before each iteration, PyTorch's default) or
            ``"held"`` (zeroed in place); use the loop the profile was made with.
        optimizer: The optimizer whose ``step()`` ends each iteration, or a factory of one
            (``torch.optim.AdamW``); ``None`` for forward + backward only.
        progress: Show a progress bar (on standard error); ``None``: when it is a terminal.

    Returns:
        The :class:`Measurement`. The model is left as it was (parameters, gradients, buffers, RNG,
        mode, and the optimizer's state).

    Raises:
        RematError: For bad ``steps``/``warmup``/``grads``/``optimizer`` or a loss that is not a scalar.
    """
    if steps < 1 or warmup < 1:
        raise RematError(f"measure: steps={steps} and warmup={warmup} must both be >= 1")
    dev = device_of(model, inputs)
    counted = _count_blocks(model, blocks)
    firsts = [mods[0] for mods in resolve(model, counted)]
    plan = applied(model)

    with iteration(model, inputs, loss_fn, grads=grads, optimizer=optimizer, where="measure") as it:
        held = it.warm_up(warmup)
        times = []
        with show_progress(progress, steps, "measure") as advance:
            for k in range(steps):
                it.reset()  # outside the timed region, as outside the measured one
                times += timed_steps(it.step, dev, 1)
                advance(f"step {k + 1}/{steps}")
        it.reset()
        with count_forwards(firsts) as counts:
            trace = record_memory(it.step, dev)
    return Measurement(
        peak_bytes=trace.peak_bytes,
        step_ms=median(times),
        step_ms_all=tuple(times),
        forward_counts={b.name: counts[id(m)] for b, m in zip(counted, firsts)},
        held_bytes=held,
        device=dev.type,
        plan=plan.strategy if plan is not None else "none",
        loop=it.loop,
    )


@dataclass(frozen=True)
class GradientCheck:
    """Plain against checkpointed gradients.

    Attributes:
        equal: Every gradient (parameters and inputs) and the loss match (bitwise when ``exact``).
        exact: Whether the comparison was bitwise (``torch.equal``) or within tolerance.
        compared: How many gradients were compared.
        mismatched: Names of the gradients that differ.
        max_abs_diff: Largest absolute difference over all gradients.
        plain_repeatable: Whether a second plain step matches the first, checked only when the gradients
            differ (None when they match): False means the model itself is not deterministic (it reseeds
            its generator, as HF's Reformer does in training), so the difference says nothing of the plan.
    """

    equal: bool
    exact: bool
    compared: int
    mismatched: tuple[str, ...]
    max_abs_diff: float
    plain_repeatable: bool | None = None


def _grads(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor]) -> dict[str, torch.Tensor | None]:
    with preserved(model, inputs):
        for p in model.parameters():
            p.grad = None
        leaves = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad]
        for t in leaves:
            t.grad = None
        # Generators of the model's own (``torch.bernoulli(p, generator=self.g)``) go back to where they
        # were, so that both runs draw the same numbers.
        watch = GeneratorWatch()
        try:
            with (
                higher_order_refused(
                    "check_gradients: the model",
                    "compare the plain and the planned model's gradients yourself (torch.equal on each parameter's .grad)",
                ),
                watch,
            ):
                loss = train_step(model, inputs, loss_fn, where="check_gradients")
        finally:
            for gen, state in watch.found.values():
                gen.set_state(state)
        out: dict[str, torch.Tensor | None] = {"loss": loss.clone()}
        out.update({f"param:{n}": None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        out.update({f"input:{i}": None if t.grad is None else t.grad.clone() for i, t in enumerate(leaves)})
    return out


def check_gradients(
    model: nn.Module,
    plan: Plan,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    exact: bool | None = None,
    atol: float = 1e-6,
    allow_stateful: bool = False,
) -> GradientCheck:
    """Compare every parameter and input gradient of the plain model with the checkpointed one.

    Both runs start from the same RNG state, so dropout draws the same masks; the model is left as it
    was (any plan applied before is put back).

    Args:
        model: The model.
        plan: The plan to check (from ``remat.plan``); the public ``remat.check_gradients`` also takes
            a strategy and plans it first.
        inputs: A tensor, tuple or dict; leaf tensors that require grad get their gradient compared.
        loss_fn: Maps the model's output to a scalar loss.
        exact: Bitwise comparison (default: on CPU yes, on CUDA no, where kernels may differ run to run).
        atol: Tolerance when not exact.
        allow_stateful: Passed to ``apply``: recompute blocks that update buffers, restoring them
            (NOTE [ State under recomputation ]); the plain run's buffer updates are put back first.

    Returns:
        The :class:`GradientCheck`.

    Raises:
        RematError: If ``plan`` is not a Plan.
    """
    if not isinstance(plan, Plan):
        raise RematError(
            f"check_gradients: expected a Plan, got {type(plan).__name__}; make one with "
            "remat.plan(model, strategy=...), or call remat.check_gradients(model, strategy, ...), which plans it first"
        )
    dev = device_of(model, inputs)
    exact = dev.type == "cpu" if exact is None else exact
    before = remove(model)
    try:
        plain = _grads(model, inputs, loss_fn)
        apply(model, plan, allow_stateful=allow_stateful)
        try:
            ckpt = _grads(model, inputs, loss_fn)
        finally:
            remove(model)
    finally:
        if before is not None:
            apply(model, before)
    check = _compare_grads(plain, ckpt, exact=exact, atol=atol)
    if check.equal:
        return check
    # Is the difference the plan's? A model that is not deterministic differs from itself.
    remove(model)
    try:
        again = _compare_grads(plain, _grads(model, inputs, loss_fn), exact=exact, atol=atol)
    finally:
        if before is not None:
            apply(model, before)
    if not again.equal:
        log.warning(
            "check_gradients: two plain steps of %s from the same RNG state differ too (%s), so the "
            "difference says nothing of the plan; the model is not deterministic: it reseeds its generator "
            "(torch.seed(), as HF's Reformer does in training), draws from one remat does not restore, keeps "
            "state across calls, or its kernels are not deterministic (torch.use_deterministic_algorithms)",
            type(model).__name__,
            ", ".join(again.mismatched[:3]),
        )
    return replace(check, plain_repeatable=again.equal)


def _compare_grads(
    plain: dict[str, torch.Tensor | None], ckpt: dict[str, torch.Tensor | None], *, exact: bool, atol: float
) -> GradientCheck:
    mismatched, worst = [], 0.0
    for name, a in plain.items():
        b = ckpt[name]
        if a is None or b is None:
            if (a is None) != (b is None):
                mismatched.append(name)
            continue
        if a.is_sparse or b.is_sparse:  # nn.Embedding(sparse=True): compare the dense values
            a, b = a.coalesce().to_dense() if a.is_sparse else a, b.coalesce().to_dense() if b.is_sparse else b
        diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        worst = max(worst, diff)
        same = torch.equal(a, b) if exact else diff <= atol
        if not same:
            mismatched.append(name)
    return GradientCheck(
        equal=not mismatched, exact=exact, compared=len(plain), mismatched=tuple(mismatched), max_abs_diff=worst
    )
