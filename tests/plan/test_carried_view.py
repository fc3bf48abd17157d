"""A block taking a view (made by the code between blocks) of a tensor the previous block edited in place
and returned: a segment over the block that made it holds it as an external argument (NOTE [ A view of a
carried output ] in remat.core.probe; fuzz seed 808, split blocks)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.errors import BudgetInfeasibleError
from remat.plan.chain import chain_of
from remat.plan.solver import simulate
from remat.plan.types import ops_from_text

D, T, B = 24, 64, 4


class _Act(nn.Module):
    def __init__(self, rebind: bool) -> None:
        super().__init__()
        self.rebind = rebind
        self.linear0, self.act_inplace1 = nn.Linear(D, D), nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.act_inplace1(self.linear0(x))  # edits the Linear's output in place and returns it
        if self.rebind:
            x = x.reshape(B, T * D).view(B, T, D)  # the ReLU's output object dies; its storage goes on
        return x


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn0 = nn.BatchNorm1d(D)

    def forward(self, x):
        return self.bn0(x.transpose(1, 2)).transpose(1, 2)  # a view of the ReLU's output: not a link


class _Net(nn.Module):
    def __init__(self, rebind: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.blocks = nn.Sequential(_Act(rebind), _Norm())
        self.drop = nn.Dropout(0.3)  # parameter-free: the head's
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 7)

    def forward(self, x):
        return self.head(self.norm(self.drop(self.blocks(self.inp(x)))))


def _step(model, x, loss_fn):
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, {n: b.clone() for n, b in model.named_buffers()}


def _case(rebind):
    torch.manual_seed(0)
    model = _Net(rebind)
    g = torch.Generator().manual_seed(0)
    x, tgt = torch.randn(B, T, 16, generator=g), torch.randn(B, T, 7, generator=g)

    def loss_fn(out):
        return F.mse_loss(out, tgt)

    blks = remat.blocks(model, named=["blocks.0.linear0", "blocks.0.act_inplace1", "blocks.1.bn0"])
    assert [b.fqns for b in blks] == [
        ("blocks.0.linear0",),
        ("blocks.0.act_inplace1",),
        ("blocks.1.bn0",),
    ]
    return model, x, loss_fn, blks


def _check(model, x, loss_fn, pl):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref_g, ref_b = _step(model, x, loss_fn)
    model.load_state_dict(state)
    remat.apply(model, pl)
    try:
        got_g, got_b = _step(model, x, loss_fn)
        model.load_state_dict(state)
        m = remat.measure(model, (x,), loss_fn, steps=1, warmup=1, progress=False)
    finally:
        remat.remove(model)
        model.load_state_dict(state)
    assert all(torch.equal(ref_g[k], got_g[k]) for k in ref_g)
    assert all(torch.equal(ref_b[k], got_b[k]) for k in ref_b)
    return m.peak_bytes


@pytest.mark.parametrize("rebind", [False, True])
def test_smallest_plan_fits_its_budget(rebind):
    model, x, loss_fn, blks = _case(rebind)
    prof = remat.profile(model, (x,), loss_fn, blocks=blks, repeats=1, progress=False)
    try:
        pl = remat.plan(prof, budget="1B")
    except BudgetInfeasibleError as e:
        pl = remat.plan(prof, budget=e.min_peak_bytes)
    peak = _check(model, x, loss_fn, pl)
    assert peak <= pl.budget_bytes * 1.05, (pl.describe(), peak, pl.budget_bytes)
    assert 0.95 <= peak / pl.predicted_peak_bytes <= 1.05, (pl.describe(), peak, pl.predicted_peak_bytes)


@pytest.mark.parametrize("rebind", [False, True])
def test_segment_over_the_maker_is_charged_the_view(rebind):
    # R[0:3] holds the Linear's output (bn0's external argument) to its backward: 1.146x its prediction before.
    model, x, loss_fn, blks = _case(rebind)
    prof = remat.profile(model, (x,), loss_fn, blocks=blks, repeats=1, progress=False)
    chain = chain_of(prof)
    assert chain.unlinked_bytes[2] == B * T * D * 4 and not chain.joinable[1]
    base = remat.plan(prof, budget="100%")
    for text in ("R[0:3](K0 K1 K2)", "K0 K1 R[2:3](K2)", "R[0:2](K0 K1) K2"):
        ops = ops_from_text(text)
        pred = simulate(chain, ops).peak_bytes
        peak = _check(
            model, x, loss_fn, dataclasses.replace(base, ops=ops, predicted_peak_bytes=pred, budget_bytes=None)
        )
        assert 0.95 <= peak / pred <= 1.05, (text, peak, pred)
