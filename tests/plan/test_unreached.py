"""Blocks the backward does not reach (their output feeds the loss only through an ``argmin``, as HF
Encodec's encoder feeds its quantizer) are kept: what they save is freed with their graph in the forward,
never by a backward, and plans that recomputed them measured 1.55x their budget (BlockProfile.backward)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import remat


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class _Codec(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.enc = nn.ModuleList(_Block(d) for _ in range(4))
        self.codebook = nn.Embedding(16, d)
        self.dec = nn.ModuleList(_Block(d) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.enc:
            x = blk(x)
        q = self.codebook(torch.cdist(x, self.codebook.weight).argmin(-1))  # no gradient to the encoder
        for blk in self.dec:
            q = blk(q)
        return q


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).mean()


def test_blocks_the_backward_does_not_reach_are_kept_and_plans_keep_their_budget() -> None:
    torch.manual_seed(0)
    model, x = _Codec(), torch.randn(256, 32)
    prof = remat.profile(model, x, _loss, repeats=1, progress=False)
    assert [bp.backward for bp in prof.block_profiles] == [False] * 4 + [True] * 2
    assert "always kept: enc.0, enc.1, enc.2, enc.3" in prof.summary()
    try:
        plan = remat.plan(prof, "1%")
    except remat.BudgetInfeasibleError as e:
        plan = remat.plan(prof, e.min_peak_bytes)
    assert not any(plan.should_checkpoint(i) for i in range(4)), plan.describe()
    planned = copy.deepcopy(model)
    remat.apply(planned, plan)
    measured = remat.measure(planned, x, _loss, steps=1).peak_bytes
    assert measured <= plan.budget_bytes * 1.05, (measured, plan.budget_bytes, plan.describe())
    assert remat.check_gradients(planned, plan, x, _loss).equal
