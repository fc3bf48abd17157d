"""Blocks listed in another order than they run in (FSMT registers its decoder before its encoder) are
profiled in the order they run: the profile refused them before, naming the order it had seen."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn

import remat


class _Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.fc(x)))


class _DecoderFirst(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.decoder = nn.ModuleList(_Layer(d) for _ in range(3))  # registered first, runs second
        self.encoder = nn.ModuleList(_Layer(d) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder:
            x = layer(x)
        for layer in self.decoder:
            x = layer(x)
        return x


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).mean()


def test_blocks_listed_out_of_run_order_are_profiled_in_the_order_they_run() -> None:
    torch.manual_seed(0)
    model, x = _DecoderFirst(), torch.randn(64, 16)
    # As remat.blocks lists FSMT's: in registration order, the decoder first.
    found = sorted(remat.blocks(model), key=lambda b: not b.name.startswith("decoder"))
    listed = [replace(b, index=i) for i, b in enumerate(found)]
    assert [b.name for b in listed][:3] == ["decoder.0", "decoder.1", "decoder.2"]
    prof = remat.profile(model, x, _loss, blocks=listed, repeats=1, progress=False)
    assert [b.name for b in prof.blocks] == [f"encoder.{i}" for i in range(3)] + [f"decoder.{i}" for i in range(3)]
    assert [b.index for b in prof.blocks] == list(range(6))
    try:
        plan = remat.plan(prof, "1%")
    except remat.BudgetInfeasibleError as e:
        plan = remat.plan(prof, e.min_peak_bytes)
    planned = copy.deepcopy(model)
    remat.apply(planned, plan)
    assert remat.measure(planned, x, _loss, steps=1).peak_bytes <= plan.budget_bytes * 1.05
    assert remat.check_gradients(planned, plan, x, _loss).equal
