"""The errors remat raises.

Every error is a :class:`RematError` (a ``RuntimeError``). Messages say where they come from, the
offending value, the valid range and the fix, e.g.::

    plan: budget 120.0MiB is below the smallest feasible peak 181.3MiB (recompute everything);
    raise the budget or lower the batch size.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

__all__ = [
    "RematError",
    "BlockSelectionError",
    "BudgetInfeasibleError",
    "PlanMismatchError",
    "MissingExtraError",
    "RematWarning",
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


class RematWarning(UserWarning):
    """Something remat cannot refuse but will not hold to: a planned model trained on a larger batch than its
    plan was profiled on, whose step can then peak above the plan's budget (gradients stay exact).

    Filter it as any warning: ``warnings.filterwarnings("error", category=remat.RematWarning)``.
    """


@contextlib.contextmanager
def higher_order_refused(where: str, fix: str) -> Iterator[None]:
    """Turns torch's ``NotImplementedError`` for a higher-order operator (``torch.cond``, ``while_loop``,
    ``scan``) run under one of remat's dispatch modes into a :class:`RematError` that names it: ``where``
    begins the message (what ran, e.g. ``"apply: module 'layers.0'"``), ``fix`` ends it.

    Torch runs such an operator under a ``TorchDispatchMode`` only through a rule registered for that mode
    class, and compiles its branches with dynamo in eager mode, which remat's modes do not support."""
    try:
        yield
    except NotImplementedError as e:
        found = re.search(r"HigherOrderOperator (\w+)", str(e))
        if found is None:
            raise
        raise RematError(
            f"{where} calls the higher-order operator torch.{found.group(1)}, which remat cannot run under the "
            f"dispatch modes it watches a forward with; {fix}"
        ) from e
