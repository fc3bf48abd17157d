"""The smallest feasible peak a ``BudgetInfeasibleError`` states is never above a plan the planner returns
(NOTE [ The smallest peak an error states ] in ``remat.plan.planner``).

Fuzz seed 804 (``benchmarks/fuzz.py``): the optimal solver's lowest-peak plan is predicted at 322,496 B,
while its plan at that budget is predicted at 319,760 B, so a budget between the two was refused though
a plan fits it. Oracle: plan at 1 byte (refused, stating the smallest peak), plan at that peak, then at
the returned plan's own prediction: both must succeed, and the stated peak is at most the prediction of
every plan returned.
"""

from __future__ import annotations

import pytest

import remat
from remat.errors import BudgetInfeasibleError
from tests.benchmark_scripts import load

fuzz = load("fuzz")


@pytest.mark.parametrize("seed", [804, 104, 2005])
def test_stated_smallest_peak_is_reached(seed: int) -> None:
    model, inputs, loss_fn, cfg = fuzz.make_case(seed)
    model.train()
    prof = remat.profile(model, inputs, loss_fn, repeats=1, progress=False, ops=cfg["ops"], grads=cfg["grads"])
    with pytest.raises(BudgetInfeasibleError) as info:
        remat.plan(prof, budget="1B")
    stated = info.value.min_peak_bytes
    at_stated = remat.plan(prof, budget=stated)
    assert at_stated.predicted_peak_bytes is not None
    assert at_stated.predicted_peak_bytes <= stated
    # The stated peak is the lowest a returned plan is predicted at: no plan below it.
    assert stated <= at_stated.predicted_peak_bytes
    again = remat.plan(prof, budget=at_stated.predicted_peak_bytes)
    assert again.predicted_peak_bytes is not None and again.predicted_peak_bytes <= at_stated.predicted_peak_bytes
