"""Fuzz seed 361 (split blocks), minimised: a late input made inside a segment and held by the model's code
after it (NOTE [ Late inputs made inside a segment ] in remat.plan.chain).

``b0`` returns a non-contiguous tensor ``h`` (``transpose().contiguous().transpose()``); ``b1.linear0`` (no bias)
saves a contiguous copy of it, not ``h``; the model's ``h`` dies only when ``b1`` returns, after ``b1.aux_head``.
Under ``R[0:3](K0 K1 K2) K3 ..`` it stays alive from the segment's end to that free, which kept ``K3`` credits:
the segment charged it nothing, and the plan measured 1.197x its prediction and budget (2389908 vs 1996692).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.plan.chain import chain_of
from remat.plan.planner import plan_from_ops

D, T, B = 48, 128, 16


def _flip(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).contiguous().transpose(0, 1)


class _Flip(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _flip(x)


class _Aux(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear0 = nn.Linear(D, D, bias=False)
        self.aux_head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = _flip(self.linear0(x))
        return x, self.aux_head(x).squeeze(-1)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.b0 = _Flip()
        self.b1 = _Aux()
        self.act = nn.SiLU()
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.b0(self.inp(x))
        h, aux = self.b1(h)  # the model's ``h`` (b0's output) dies here, after b1.aux_head
        return self.head(self.norm(self.act(h))), aux.mean()


_BLOCKS = ["inp", "b0", "b1.linear0", "b1.aux_head", "act", "norm", "head"]


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, tgt = torch.randn(B, T, 5, generator=g), torch.randn(B, T, 1, generator=g)

    def loss_fn(out):
        return F.mse_loss(out[0], tgt) + 0.1 * out[1]

    model = _Net()
    prof = remat.profile(model, (x,), loss_fn, blocks=remat.blocks(model, named=_BLOCKS), repeats=1, progress=False)
    return model, x, loss_fn, prof


def _grads(model, x, loss_fn):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss_fn(model(x)).backward()
    return [p.grad.clone() for p in model.parameters()]


def _check(model, x, loss_fn, plan) -> None:
    ref = _grads(copy.deepcopy(model), x, loss_fn)
    m = copy.deepcopy(model)
    remat.apply(m, plan)
    try:
        peak = remat.measure(m, (x,), loss_fn, steps=1, warmup=1, progress=False).peak_bytes
        got = _grads(m, x, loss_fn)
    finally:
        remat.remove(m)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    pred = plan.predicted_peak_bytes
    assert 0.95 * pred <= peak <= 1.05 * pred, (plan.describe(), peak, pred, peak / pred)
    if plan.budget_bytes is not None:
        assert peak <= 1.05 * plan.budget_bytes, (plan.describe(), peak, plan.budget_bytes)


def test_the_profile_finds_the_late_input_made_inside(case) -> None:
    _, _, _, prof = case
    size = B * T * D * 4
    assert (size, 1, 3, (2,)) in {(li.nbytes, li.producer, li.freed_after, tuple(li.users)) for li in prof.late_inputs}
    chain = chain_of(prof)
    # Made by block 1, taken by block 2, freed after block 3: a segment 0..2 or 1..2 holds it from its end.
    assert chain.late_made_bytes(0, 3) == chain.late_made_bytes(1, 3) == size
    assert chain.late_made_bytes(2, 3) == chain.late_made_bytes(0, 2) == chain.late_made_bytes(0, 4) == 0


def test_a_segment_that_makes_it_is_predicted(case) -> None:
    model, x, loss_fn, prof = case
    ops = (Recompute(0, 3, (Keep(0), Keep(1), Keep(2))), *(Keep(k) for k in range(3, 7)))
    _check(model, x, loss_fn, plan_from_ops(prof, ops, "by hand"))


def test_the_smallest_budget_is_met(case) -> None:
    model, x, loss_fn, prof = case
    with pytest.raises(remat.BudgetInfeasibleError) as info:
        remat.plan(prof, budget="1B")
    _check(model, x, loss_fn, remat.plan(prof, budget=info.value.min_peak_bytes))
