"""Comparing plans on one model in one run: the engine behind ``remat bench``.

Timings are interleaved (round r runs every plan once before round r + 1 starts) and reported as
medians, so slow drifts of the machine hit every plan alike; peaks come from one profiled step each;
every plan's gradients are compared with the plain model's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from remat.apply import apply, remove
from remat.apply.runtime import count_forwards
from remat.blocks import resolve
from remat.errors import RematError
from remat.measure import _compare_grads, _grads
from remat.measure.trace import (
    device_of,
    held_bytes,
    median,
    preserved,
    record_memory,
    timed_steps,
    train_step,
    zero_grads,
)
from remat.plan.types import Plan

__all__ = ["BenchRow", "BenchResult", "compare"]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BenchRow:
    """One plan's measured (and predicted) figures.

    Attributes:
        label: The plan's strategy or solver label.
        checkpointed: Blocks checkpointed (wholly or through a sub-module).
        n_blocks: Blocks in the model.
        depth: Nesting depth of the plan.
        peak_bytes: Measured peak of a step above the held memory, bytes.
        step_ms: Median measured step time, milliseconds.
        step_ms_all: Every timed step, milliseconds.
        saved_pct: Memory saved against the baseline row, percent.
        overhead_pct: Time overhead against the baseline row, percent.
        grads_equal: Every gradient equal to the plain model's (bitwise on CPU).
        forward_counts: Forward runs of each block in one step.
        predicted_peak_bytes: The plan's predicted peak, bytes (``None`` without a profile).
        predicted_extra_ms: The plan's predicted recompute time, milliseconds.
        budget_bytes: The budget the plan was solved for, bytes.
        ops: The plan in compact form.
    """

    label: str
    checkpointed: int
    n_blocks: int
    depth: int
    peak_bytes: int
    step_ms: float
    step_ms_all: tuple[float, ...]
    saved_pct: float
    overhead_pct: float
    grads_equal: bool
    forward_counts: dict[str, int]
    predicted_peak_bytes: int | None
    predicted_extra_ms: float | None
    budget_bytes: int | None
    ops: str


@dataclass(frozen=True)
class BenchResult:
    """Every plan measured in one run, against the first (the baseline).

    Attributes:
        model: Description of the workload.
        device: ``"cpu"`` or ``"cuda"``.
        held_bytes: Memory held before a step, bytes.
        rounds: Interleaved timing rounds.
        rows: One per plan; ``rows[0]`` is the baseline.
    """

    schema_version: ClassVar[int] = 1

    model: str
    device: str
    held_bytes: int
    rounds: int
    rows: tuple[BenchRow, ...]

    def to_json(self) -> str:
        """Serialise to a JSON string (with ``schema_version``)."""
        return json.dumps({"schema_version": self.schema_version, **asdict(self)}, indent=2)


def compare(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    plans: Sequence[Plan],
    *,
    rounds: int = 5,
    description: str = "",
    progress: Progress | None = None,
) -> BenchResult:
    """Measure every plan on the same model and batch in one run.

    Args:
        model: The model (left as it was afterwards).
        inputs: A tensor, a tuple of positional arguments or a dict of keyword arguments.
        loss_fn: Maps the model's output to a scalar loss.
        plans: The plans; the first is the baseline for the saved / overhead percentages.
        rounds: Interleaved timing rounds (each plan runs once per round), >= 1.
        description: Free text naming the workload.
        progress: Called with a short label after each unit of work.

    Returns:
        The :class:`BenchResult`.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise RematError(f"bench: rounds={rounds!r} must be an integer >= 1 (interleaved timing rounds)")
    if not plans:
        raise RematError("bench: no plans to compare; give at least the baseline plan")
    dev = device_of(model, inputs)
    tick = progress or (lambda _label: None)
    def step() -> None:
        zero_grads(model)
        train_step(model, inputs, loss_fn)

    before = remove(model)
    peaks: list[int] = []
    counts: list[dict[str, int]] = []
    equal: list[bool] = []
    times: list[list[float]] = [[] for _ in plans]
    try:
        with preserved(model, inputs):
            plain = _grads(model, inputs, loss_fn)
            held = 0
            for plan in plans:
                apply(model, plan)
                try:
                    # preserved(): every plan starts from the plain run's RNG state (same dropout masks).
                    with preserved(model, inputs):
                        ckpt = _grads(model, inputs, loss_fn)
                        equal.append(_compare_grads(plain, ckpt, exact=dev.type == "cpu", atol=1e-6).equal)
                        zero_grads(model)
                        train_step(model, inputs, loss_fn)  # warm-up; leaves gradients allocated
                        held = held_bytes(model, inputs)
                        firsts = [mods[0] for mods in resolve(model, plan.blocks)]
                        with count_forwards(firsts) as c:
                            trace = record_memory(step, dev)
                    peaks.append(trace.peak_bytes)
                    counts.append({b.name: c[id(m)] for b, m in zip(plan.blocks, firsts)})
                finally:
                    remove(model)
                tick(f"{plan.strategy}: peak and gradients")
            for r in range(rounds):
                for i, plan in enumerate(plans):
                    apply(model, plan)
                    try:
                        zero_grads(model)
                        times[i] += timed_steps(lambda: train_step(model, inputs, loss_fn), dev, 1)
                    finally:
                        remove(model)
                tick(f"timing round {r + 1}/{rounds}")
    finally:
        if before is not None:
            apply(model, before)
    base_peak, base_ms = peaks[0], median(times[0])
    rows = []
    for i, plan in enumerate(plans):
        ms = median(times[i])
        rows.append(
            BenchRow(
                label=plan.strategy,
                checkpointed=len(plan.checkpointed),
                n_blocks=len(plan.blocks),
                depth=plan.depth,
                peak_bytes=peaks[i],
                step_ms=ms,
                step_ms_all=tuple(times[i]),
                saved_pct=100.0 * (1 - peaks[i] / base_peak) if base_peak else 0.0,
                overhead_pct=100.0 * (ms / base_ms - 1) if base_ms else 0.0,
                grads_equal=equal[i],
                forward_counts=counts[i],
                predicted_peak_bytes=plan.predicted_peak_bytes,
                predicted_extra_ms=plan.predicted_extra_ms,
                budget_bytes=plan.budget_bytes,
                ops=plan.describe(),
            )
        )
    return BenchResult(model=description, device=dev.type, held_bytes=held, rounds=rounds, rows=tuple(rows))
