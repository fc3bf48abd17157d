"""Blocks whose outputs need no gradient (NOTE [ Blocks whose outputs need no gradient ] in remat.core.probe).

The first blocks are frozen and take an input without a gradient (HF Conditional DETR's backbone stages): they
save nothing, no backward reaches them, and a checkpoint over one holds nothing. The chain model charged such a
segment its input, an RNG state and the inputs it would hold (Conditional DETR ``full()`` 0.933x its prediction,
split 0.931x); now it is charged as the kept block it behaves as.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep
from remat.errors import BudgetInfeasibleError
from tests.oracle import measured_bitwise

D, B = 64, 256


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(D, D), nn.GELU()) for _ in range(6)]
    for layer in layers[:3]:
        layer.requires_grad_(False)
    return nn.Sequential(*layers)


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


@pytest.fixture(scope="module")
def case():
    model, x = _model(), torch.randn(B, D)
    prof = remat.profile(model, (x,), _loss, repeats=1, progress=False)
    return model, x, prof


def test_frozen_blocks_are_not_reached(case) -> None:
    _, _, prof = case
    assert [bp.backward for bp in prof.block_profiles] == [False] * 3 + [True] * 3


@pytest.mark.parametrize("strategy", ["full", "sqrt"])
def test_checkpoints_over_them_are_predicted(case, strategy) -> None:
    model, x, prof = case
    plan = remat.plan(prof, strategy=strategy)
    peak = measured_bitwise(model, x, _loss, plan, grads="none")
    assert 0.98 * plan.predicted_peak_bytes <= peak <= 1.02 * plan.predicted_peak_bytes, (
        plan.describe(),
        peak,
        plan.predicted_peak_bytes,
    )


def test_the_smallest_plan_keeps_them_and_fits(case) -> None:
    model, x, prof = case
    with pytest.raises(BudgetInfeasibleError) as info:
        remat.plan(prof, budget="1B")
    plan = remat.plan(prof, budget=info.value.min_peak_bytes)
    assert all(isinstance(plan.ops[i], Keep) for i in range(3)), plan.describe()
    assert measured_bitwise(model, x, _loss, plan, grads="none") <= plan.predicted_peak_bytes
