"""``remat.frontier``: the optimal trade-off between peak memory and recompute time, across budgets."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, ClassVar

from remat._json import Reader, read
from remat.errors import BudgetInfeasibleError, RematError
from remat.plan.chain import chain_of
from remat.plan.planner import plan, solver_named
from remat.plan.solver import simulate
from remat.plan.strategies import bench_strategies, none

if TYPE_CHECKING:
    from remat.profile.types import Profile

__all__ = ["frontier", "Frontier", "FrontierPoint"]


@dataclass(frozen=True)
class FrontierPoint:
    """One point of the optimal trade-off: a budget and the best plan's predicted cost.

    Attributes:
        budget_bytes: The budget solved for, bytes.
        peak_bytes: Predicted peak of the optimal plan, bytes.
        extra_ms: Predicted recompute time per step, milliseconds.
        ops: The plan in compact form.
    """

    budget_bytes: int
    peak_bytes: int
    extra_ms: float
    ops: str


@dataclass(frozen=True)
class Frontier:
    """The optimal (peak, extra time) points across budgets, and where each seed strategy falls.

    Attributes:
        points: Optimal plans from the smallest feasible peak to keeping everything, by rising peak.
        strategies: ``(label, predicted peak bytes, predicted extra ms)`` of every strategy.
        baseline_peak_bytes: Measured unplanned peak, bytes.
        baseline_step_ms: Measured plain step time, milliseconds.
    """

    schema_version: ClassVar[int] = 1

    points: tuple[FrontierPoint, ...]
    strategies: tuple[tuple[str, int, float], ...]
    baseline_peak_bytes: int
    baseline_step_ms: float

    def to_json(self) -> str:
        """Serialise to a JSON string (with ``schema_version``)."""
        return json.dumps({"schema_version": self.schema_version, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Frontier:
        """Read a frontier written by :meth:`to_json` (NOTE [ One loading policy ] in ``remat._json``).

        Raises:
            RematError: If the text is not a frontier of this schema version, or lacks or mistypes a field.
        """
        fix = "compute it again with remat.frontier(profile).to_json() or `remat bench MODEL --out DIR`"
        return read(cls, text, Reader("frontier", fix))


def frontier(profile: Profile, *, points: int = 16, solver: str = "optimal") -> Frontier:
    """The optimal trade-off between peak memory and recompute time on ``profile``.

    Args:
        profile: From ``remat.profile``.
        points: How many budgets to solve for, evenly spaced from the smallest feasible peak to the
            keep-everything peak, >= 2.
        solver: A name in ``SOLVERS`` (``from remat.plan import SOLVERS``): ``"optimal"``, ``"knapsack"``
            or ``"compile"``.

    Returns:
        The :class:`Frontier` (Pareto points only) with every seed strategy's predicted figures.

    Raises:
        RematError: For ``points`` below 2 or an unknown solver.
    """
    if points < 2:
        raise RematError(f"frontier: points={points} must be >= 2")
    chosen = solver_named(solver, where="frontier")
    chain = chain_of(profile)
    low = chosen.min_peak(profile, chain)
    high = simulate(chain, tuple(plan(profile, strategy=none()).ops)).peak_bytes
    found: list[FrontierPoint] = []
    for i in range(points):
        b = low + (high - low) * i // (points - 1)
        try:
            p = plan(profile, max(b, low), solver=solver)
        except BudgetInfeasibleError:
            continue  # discretisation can make the very lowest budget unreachable
        assert p.predicted_peak_bytes is not None and p.predicted_extra_ms is not None
        found.append(FrontierPoint(b, p.predicted_peak_bytes, p.predicted_extra_ms, p.describe()))
    pareto: list[FrontierPoint] = []
    for pt in sorted(found, key=lambda q: (q.peak_bytes, q.extra_ms)):
        if not pareto or pt.extra_ms < pareto[-1].extra_ms - 1e-9:
            pareto.append(pt)
    strategies = []
    for s in bench_strategies(profile.blocks, profile):
        sp = plan(profile, strategy=s)
        assert sp.predicted_peak_bytes is not None and sp.predicted_extra_ms is not None
        strategies.append((s.label, sp.predicted_peak_bytes, sp.predicted_extra_ms))
    return Frontier(tuple(pareto), tuple(strategies), profile.peak_bytes, profile.step_ms)
