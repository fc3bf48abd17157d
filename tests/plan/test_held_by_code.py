"""Fuzz seeds 172 / 2082 (split blocks), hand-written: a block's output that the model's Python code holds past
the last block that takes it, which saves it in the plain step (NOTE [ Outputs the model's code holds past
their saving taker ] in remat.profile.profiler).

``h = self.ln(x); x = x + self.down(self.act(self.up(h)))``: ``up`` saves ``h`` in the plain step, so no free
shows that the local ``h`` keeps it alive until ``forward`` returns (after ``out``), nor that ``x`` (``pre``'s
output, which ``ln`` saves) lives until the sum. Under ``R[pre..up]`` nothing saves them, yet the code holds
them from the segment's end: the segment charged neither, and the plan measured over its prediction/budget.
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

D, T, B = 24, 32, 8


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(2 * D, D)
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.act = nn.GELU()
        self.down = nn.Linear(2 * D, D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.split([D // 2, D - D // 2], dim=-1)
        x = self.pre(torch.cat([b, a, x], dim=-1))
        h = self.ln(x)
        x = x + self.down(self.act(self.up(h)))  # pre's output dies here; ln's (h) when forward returns
        return self.out(x)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.conv = nn.Conv1d(D, D, 3, padding=2)
        self.blk = _Residual()
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.conv(h.transpose(1, 2))[..., :T].transpose(1, 2)
        h = self.blk(h)
        return self.head(self.norm(h))


_BLOCKS = ["inp", "conv", "blk.pre", "blk.ln", "blk.up", "blk.act", "blk.down", "blk.out"]


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, tgt = torch.randn(B, T, 16, generator=g), torch.randn(B, T, 1, generator=g)

    def loss_fn(out):
        return F.mse_loss(out, tgt)

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


def test_the_profile_finds_what_the_code_holds(case) -> None:
    _, _, _, prof = case
    size = B * T * D * 4
    held = {(li.nbytes, li.producer, li.freed_after, tuple(li.users)) for li in prof.code_held_inputs}
    assert (size, 2, 6, (3,)) in held  # pre's output: ln takes it, the sum after down drops it
    assert (size, 3, 7, (4,)) in held  # h: up takes it, the block's return (after out) drops it
    chain = chain_of(prof)
    assert chain.late_made_bytes(2, 5) == 2 * size
    assert chain.late_made_bytes(4, 5) == chain.late_made_bytes(0, 8) == 0


@pytest.mark.parametrize("start", [2, 3])
def test_a_segment_over_the_saving_taker_is_predicted(case, start) -> None:
    model, x, loss_fn, prof = case
    ops = (*(Keep(k) for k in range(start)), Recompute(start, 5, tuple(Keep(k) for k in range(start, 5))))
    ops += tuple(Keep(k) for k in range(5, 8))
    _check(model, x, loss_fn, plan_from_ops(prof, ops, "by hand"))


def test_the_smallest_budget_is_met(case) -> None:
    model, x, loss_fn, prof = case
    with pytest.raises(remat.BudgetInfeasibleError) as info:
        remat.plan(prof, budget="1B")
    _check(model, x, loss_fn, remat.plan(prof, budget=info.value.min_peak_bytes))
