"""The backward of the code between blocks runs before a segment's replay (NOTE [ The gap's backward runs before
the replay ] in remat.plan.solver).

Blocks are MLPs; the model's code runs a LayerNorm and a SiLU after each one, which hold their output and what they
save until their backward, which runs between the next block's backward and this one's. The simulator held what
that code left through the replay of a segment ending with the block, and charged the code's backward window
inside the replayed block's backward, above the replay: ``full()`` measured 0.936x its prediction, two
single-block segments 0.973x; the same charge on a kept block's own backward window, twice.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.errors import BudgetInfeasibleError
from remat.plan.chain import chain_of
from remat.plan.planner import plan_from_ops
from tests.oracle import measured_bitwise

N, D, B, T = 6, 64, 32, 16


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_MLP() for _ in range(N))
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, norm in zip(self.layers, self.norms, strict=True):
            x = nn.functional.silu(norm(layer(x)))  # the gap: held until its own backward
        return x


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(B, T, D)
    prof = remat.profile(model, (x,), _loss, repeats=1, progress=False)
    return model, x, prof


def test_the_two_backward_windows_make_the_measured_peak(case) -> None:
    _, _, prof = case
    for bp in prof.block_profiles:
        assert bp.bwd_own_peak_bytes is not None and bp.bwd_code_peak_bytes is not None
        # Both above the level holding what the code after the block left; bwd_peak_bytes takes the own
        # window above the level at the forward's end.
        assert bp.bwd_peak_bytes == max(bp.bwd_own_peak_bytes + max(0, bp.gap_bytes), bp.bwd_code_peak_bytes)
    assert any(bp.gap_bytes > 0 for bp in prof.block_profiles)


def _by_hand(prof: remat.Profile) -> remat.Plan:
    ops = (Keep(0), Keep(1), Recompute(2, 3, (Keep(2),)), Keep(3), Recompute(4, 5, (Keep(4),)), Keep(5))
    return plan_from_ops(prof, ops, "by hand")


@pytest.mark.parametrize("which", ["full", "sqrt", "by hand", "none"])
def test_plans_are_predicted_within_two_percent(case, which) -> None:
    model, x, prof = case
    plan = _by_hand(prof) if which == "by hand" else remat.plan(prof, strategy=which)
    peak = measured_bitwise(model, x, _loss, plan, grads="none")
    # full() 0.936 and the hand-made plan 0.973 of their predictions before; sqrt()'s segment over three blocks
    # still charges what the code between its blocks made twice (see the report), on the safe side.
    low = 0.95 if which == "sqrt" else 0.98
    assert low * plan.predicted_peak_bytes <= peak <= 1.02 * plan.predicted_peak_bytes, (
        plan.describe(),
        peak,
        plan.predicted_peak_bytes,
    )


def test_the_solvers_tables_stay_above_the_simulation(case) -> None:
    _, _, prof = case
    plan = remat.plan(prof, strategy="full")
    # The DP's smallest feasible peak is stated from its tables, which charge the old, higher figures for a
    # segment's replay: never below what the simulator predicts for the plan they propose.
    with pytest.raises(BudgetInfeasibleError) as info:
        remat.plan(prof, budget="5%")
    lowest = remat.plan(prof, budget=info.value.min_peak_bytes)
    assert lowest.predicted_peak_bytes <= info.value.min_peak_bytes
    assert info.value.min_peak_bytes >= plan.predicted_peak_bytes  # full() is the smallest plan here


def test_profiles_without_the_windows_keep_the_old_charges(case) -> None:
    model, x, prof = case
    old = dataclasses.replace(
        prof,
        block_profiles=tuple(
            dataclasses.replace(bp, bwd_own_peak_bytes=None, bwd_code_peak_bytes=None) for bp in prof.block_profiles
        ),
    )
    chain = chain_of(old)
    assert chain.stop_bwd_peak_bytes == chain.bwd_peak_bytes
    assert not any(chain.code_bwd_peak_bytes)
    new, before = remat.plan(prof, strategy="full"), remat.plan(old, strategy="full")
    assert before.predicted_peak_bytes > new.predicted_peak_bytes
    assert measured_bitwise(model, x, _loss, before, grads="none") <= before.predicted_peak_bytes
