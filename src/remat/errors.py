"""The errors remat raises.

Every error is a :class:`RematError` (a ``RuntimeError``). Messages say where they come from, the
offending value, the valid range and the fix, e.g.::

    plan: budget 120.0MiB is below the smallest feasible peak 181.3MiB (recompute everything);
    raise the budget or lower the batch size.
"""

from __future__ import annotations

__all__ = [
    "RematError",
    "BlockSelectionError",
    "BudgetInfeasibleError",
    "PlanMismatchError",
    "MissingExtraError",
]


class RematError(RuntimeError):
    """Base class of every error remat raises on purpose."""


class BlockSelectionError(RematError):
    """The blocks asked for do not exist, overlap, or are not consecutive in forward order."""


class BudgetInfeasibleError(RematError):
    """No plan fits the memory budget.

    Attributes:
        budget_bytes: The budget that was asked for, in bytes.
        min_peak_bytes: The smallest peak any plan reaches on this profile, in bytes.
    """

    def __init__(self, message: str, *, budget_bytes: int, min_peak_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes


class PlanMismatchError(RematError):
    """A plan was applied to a model whose blocks differ from the ones it was made for."""


class MissingExtraError(RematError):
    """An optional dependency (an "extra") is not installed."""
