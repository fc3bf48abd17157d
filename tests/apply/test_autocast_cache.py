"""A plan made and measured inside one autocast region that holds the backward too: autocast's cached
casts of the weights live to the region's end whatever the plan (NOTE [ Autocast's cached weight casts ]
in remat/core/probe.py), and a replay's fresh input leaves were cast and cached again. Plans measured
1.04-1.10x their prediction and budget (helper-47); with the cache off they were exact."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat


class _Block(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x).float()


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.float().pow(2).mean()


@pytest.mark.parametrize("strategy", [remat.full(), remat.ffn_only()], ids=["full", "ffn_only"])
def test_plans_under_a_cached_autocast_region_measure_what_they_predict(strategy: remat.Strategy) -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(*(_Block() for _ in range(4))), torch.randn(128, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # forward, backward and the measurement inside
        prof = remat.profile(model, x, _loss, repeats=1, ops=False, progress=False)
        plan = remat.plan(prof, strategy=strategy)
        planned = copy.deepcopy(model)
        remat.apply(planned, plan)
        measured = remat.measure(planned, x, _loss, steps=1).peak_bytes
    assert measured <= plan.predicted_peak_bytes * 1.01, (measured, plan.predicted_peak_bytes, plan.describe())
