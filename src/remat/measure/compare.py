"""Comparing plans on one model in one run: the engine behind ``remat bench``.

Timings are interleaved (round r runs every plan once before round r + 1 starts) and reported as
medians, so slow drifts of the machine hit every plan alike; peaks come from one profiled step each;
every plan's gradients are compared with the plain model's.

# NOTE [ Timing noise ]
A median hides how much the rounds disagreed. Each plan's *spread* is the interquartile range of its
per-round step times over their median (percent; ``None`` with a single round, where it cannot be
measured). Two plans are *separable* when their medians differ by more than the larger of their two
spreads; only then may a table or summary say that one is faster. The bench as a whole cannot rank
its plans when the typical spread (median over plans) is larger than the typical difference between
two plans (median over all pairs of the relative difference of their medians); the tables then
print a warning with both figures. On a busy machine the spread is tens of percent and every
ranking is noise; on an idle one it is a few percent.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from remat._json import Reader, load
from remat.apply import apply, remove
from remat.blocks import resolve
from remat.core.runtime import count_forwards
from remat.core.trace import (
    Grads,
    Loop,
    OptimizerLike,
    _optimizer_kept,
    _parameters_kept,
    device_of,
    iteration,
    median,
    preserved,
    record_memory,
    timed_steps,
)
from remat.errors import RematError
from remat.measure import _compare_grads, _grads
from remat.plan.types import Plan

__all__ = ["BenchPlan", "BenchRow", "BenchResult", "compare", "spread_pct", "separable"]

Progress = Callable[[str], None]


class BenchPlan(NamedTuple):
    """A plan to bench, with the solver that made it.

    Attributes:
        plan: The plan.
        solver: The solver that made it for its budget (``"optimal"``, ``"knapsack"``), ``None`` for a
            rule-of-thumb strategy or a plan made by hand; recorded in its :class:`BenchRow`.
    """

    plan: Plan
    solver: str | None = None


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
        spread_pct: Run-to-run spread of the step time: interquartile range over median of
            ``step_ms_all``, percent (``None`` with one round); see NOTE [ Timing noise ].
        solver: The solver that made the plan (``"optimal"``, ``"knapsack"``), ``None`` for a strategy.
        plan: The plan measured (``None`` in files written before rows carried it): a report finds a
            plan's row by it (:meth:`BenchResult.row_of`), never by its label.
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
    spread_pct: float | None = None
    solver: str | None = None
    plan: Plan | None = None


def spread_pct(times_ms: Sequence[float]) -> float | None:
    """Interquartile range over median of per-round times, percent (``None`` for fewer than 2 times).

    See NOTE [ Timing noise ].
    """
    if len(times_ms) < 2:
        return None
    q1, q2, q3 = statistics.quantiles(times_ms, n=4, method="inclusive")
    return 100.0 * (q3 - q1) / q2 if q2 > 0 else None


def separable(a: BenchRow, b: BenchRow) -> bool:
    """Whether the medians of ``a`` and ``b`` differ by more than the larger of their spreads (NOTE [ Timing noise ])."""
    if a.spread_pct is None or b.spread_pct is None or min(a.step_ms, b.step_ms) <= 0:
        return False
    return 100.0 * abs(a.step_ms - b.step_ms) / min(a.step_ms, b.step_ms) > max(a.spread_pct, b.spread_pct)


@dataclass(frozen=True)
class BenchResult:
    """Every plan measured in one run, against the first (the baseline).

    Attributes:
        model: Description of the workload.
        device: ``"cpu"`` or ``"cuda"``.
        held_bytes: Memory held before a step, bytes.
        rounds: Interleaved timing rounds.
        rows: One per plan; ``rows[0]`` is the baseline.
        loop: The training iteration measured (``Loop.describe()`` says what a peak means).
    """

    schema_version: ClassVar[int] = 1

    model: str
    device: str
    held_bytes: int
    rounds: int
    rows: tuple[BenchRow, ...]
    loop: Loop = Loop(Grads.HELD)

    @property
    def noise_pct(self) -> float | None:
        """The typical run-to-run spread: median over plans of their spreads, percent (``None``: one round)."""
        spreads = [r.spread_pct for r in self.rows if r.spread_pct is not None]
        return statistics.median(spreads) if spreads else None

    @property
    def difference_pct(self) -> float | None:
        """The typical difference between two plans: median over pairs of ``|a - b| / min(a, b)``, percent."""
        ms = [r.step_ms for r in self.rows if r.step_ms > 0]
        diffs = [100.0 * abs(a - b) / min(a, b) for i, a in enumerate(ms) for b in ms[i + 1 :]]
        return statistics.median(diffs) if diffs else None

    @property
    def rankable(self) -> bool:
        """Whether the step times can rank the plans: the typical spread is below the typical difference."""
        noise, diff = self.noise_pct, self.difference_pct
        return diff is None or (noise is not None and noise < diff)

    def row_of(self, plan: Plan) -> BenchRow | None:
        """The row that measured ``plan``: the row carrying an equal plan; for rows read from files
        written before rows carried their plan, the row with its label and compact form; else ``None``."""
        for r in self.rows:
            if r.plan is not None and r.plan == plan:
                return r
        describe = plan.describe()
        return next((r for r in self.rows if r.plan is None and r.label == plan.strategy and r.ops == describe), None)

    def to_json(self) -> str:
        """Serialise to a JSON string (with ``schema_version``, and the noise figures of NOTE [ Timing noise ],
        which :meth:`from_json` recomputes rather than reads)."""
        rows = []
        for r in self.rows:
            row = {f.name: getattr(r, f.name) for f in fields(r)}
            row["plan"] = None if r.plan is None else r.plan.to_dict()
            rows.append(row)
        data = {
            "schema_version": self.schema_version,
            "model": self.model,
            "device": self.device,
            "held_bytes": self.held_bytes,
            "rounds": self.rounds,
            "rows": rows,
            "loop": {"grads": self.loop.grads.value, "optimizer": self.loop.optimizer},
            "noise_pct": self.noise_pct,
            "difference_pct": self.difference_pct,
            "rankable": self.rankable,
        }
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> BenchResult:
        """Read a bench written by :meth:`to_json` (NOTE [ One loading policy ] in ``remat._json``).

        Raises:
            RematError: If the text is not a bench of this schema version, lacks or mistypes a field, or
                a row's plan is not a valid plan (as ``Plan.from_json`` checks it).
        """
        data = load(text, _READER, cls.schema_version)
        for key in _DERIVED:
            data.pop(key, None)
        return _READER.build(cls, data, convert={"rows": _read_rows})


_READER = Reader("bench", "measure again with `remat bench MODEL --json bench.json` or compare(...).to_json()")
# Figures to_json writes for people and tools, derived from the rows: recomputed when read, never read.
_DERIVED = ("noise_pct", "difference_pct", "rankable")


def _read_rows(reader: Reader, value: Any, path: str) -> tuple[BenchRow, ...]:
    items = reader.value(list[Any], value, path)

    def plan(r: Reader, v: Any, at: str) -> Plan | None:
        return None if v is None else Plan.from_dict(v, r, at)

    return tuple(reader.build(BenchRow, item, f"{path}[{i}]", {"plan": plan}) for i, item in enumerate(items))


def compare(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    plans: Sequence[Plan | BenchPlan],
    *,
    rounds: int = 5,
    description: str = "",
    progress: Progress | None = None,
    grads: Grads | str = Grads.NONE,
    optimizer: OptimizerLike | None = None,
) -> BenchResult:
    """Measure every plan on the same model and batch in one run.

    Args:
        model: The model (left as it was afterwards).
        inputs: A tensor, a tuple of positional arguments or a dict of keyword arguments.
        loss_fn: Maps the model's output to a scalar loss.
        plans: The plans (or :class:`BenchPlan` entries naming the solver of each); the first is the baseline
            for the saved / overhead percentages.
        rounds: Interleaved timing rounds (each plan runs once per round), >= 1.
        description: Free text naming the workload.
        progress: Called with a short label after each unit of work.
        grads: The user's loop: gradients set to ``None`` before each iteration (``"none"``, PyTorch's
            default) or zeroed in place (``"held"``); see ``remat.measure.Loop``.
        optimizer: An optimizer (or a factory of one) whose step ends each iteration, or ``None``.

    Returns:
        The :class:`BenchResult`.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise RematError(f"bench: rounds={rounds!r} must be an integer >= 1 (interleaved timing rounds)")
    if not plans:
        raise RematError("bench: no plans to compare; give at least the baseline plan")
    entries = [p if isinstance(p, BenchPlan) else BenchPlan(p) for p in plans]
    dev = device_of(model, inputs)
    tick = progress or (lambda _label: None)
    before = remove(model)
    peaks: list[int] = []
    counts: list[dict[str, int]] = []
    equal: list[bool] = []
    times: list[list[float]] = [[] for _ in plans]
    try:
        with iteration(model, inputs, loss_fn, grads=grads, optimizer=optimizer, where="bench") as it:
            loop = it.loop
            plain = _grads(model, inputs, loss_fn)
            held = 0
            params = list(model.parameters())
            for plan, _ in entries:
                apply(model, plan)
                try:
                    # preserved(): every plan starts from the plain run's RNG state (same dropout masks),
                    # and from the same parameters and optimizer state.
                    with preserved(model, inputs), _parameters_kept(params), _kept(it.optimizer):
                        ckpt = _grads(model, inputs, loss_fn)
                        equal.append(_compare_grads(plain, ckpt, exact=dev.type == "cpu", atol=1e-6).equal)
                        held = it.warm_up(1)
                        firsts = [mods[0] for mods in resolve(model, plan.blocks)]
                        with count_forwards(firsts) as c:
                            trace = record_memory(it.step, dev)
                    peaks.append(trace.peak_bytes)
                    counts.append({b.name: c[id(m)] for b, m in zip(plan.blocks, firsts)})
                finally:
                    remove(model)
                tick(f"{plan.strategy}: peak and gradients")
            for r in range(rounds):
                for i, (plan, _) in enumerate(entries):
                    apply(model, plan)
                    try:
                        # NOTE [ The learning step is not timed ]: the first call of each block after apply
                        # learns what it changes and draws (NOTE [ State under recomputation ] in
                        # remat.core.runtime), once per training run; timed, it made a recomputed layer of
                        # the default GPT look 5-20 ms dearer per round. One untimed step learns it (the
                        # baseline runs one too, so every row is timed with warm caches).
                        it.run()
                        it.reset()  # outside the timed region, as remat.measure does
                        times[i] += timed_steps(it.step, dev, 1)
                    finally:
                        remove(model)
                tick(f"timing round {r + 1}/{rounds}")
    finally:
        if before is not None:
            apply(model, before)
    base_peak, base_ms = peaks[0], median(times[0])
    rows = []
    for i, (plan, solver) in enumerate(entries):
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
                spread_pct=spread_pct(times[i]),
                solver=solver,
                plan=plan,
            )
        )
    return BenchResult(model=description, device=dev.type, held_bytes=held, rounds=rounds, rows=tuple(rows), loop=loop)


def _kept(optimizer: torch.optim.Optimizer | None) -> contextlib.AbstractContextManager[None]:
    return _optimizer_kept(optimizer) if optimizer is not None else contextlib.nullcontext()
