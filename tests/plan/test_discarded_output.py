"""Layers that return (h, aux) where the model discards aux (HF style: `outputs = layer(h); h = outputs[0]`):
aux lives only until the next layer's call rebinds `outputs`, and never reaches the backward. Predictions
must stay upper bounds of the measured peak and within 5% of it, the side output must not make the blocks
look reused / pinned (not a chain), and the smallest feasible peak BudgetInfeasibleError states must not
exceed what remat.full() really reaches (else a feasible budget is refused)."""

import importlib

import pytest
import torch
from torch import nn

import remat
from remat.errors import BudgetInfeasibleError


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor):
        a = torch.relu(self.fc1(h))
        aux = a.unsqueeze(-1) * a.unsqueeze(-2)[..., :16]  # a large side output nobody saves
        return h + self.fc2(a), aux


class Net(nn.Module):
    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            outputs = layer(h)  # the previous `outputs` (and its aux) dies on this rebinding
            h = outputs[0]
        return self.head(h)


def loss_fn(o: torch.Tensor) -> torch.Tensor:
    return o.pow(2).mean()


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(256, 32)
    prof = remat.profile(model, x, loss_fn, repeats=1, progress=False, ops=False)
    return model, x, prof


def _grads(model, x):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _check(model, x, plan):
    want = _grads(model, x)
    remat.apply(model, plan)
    try:
        got = _grads(model, x)
        assert all(torch.equal(got[n], want[n]) for n in want)
        m = remat.measure(model, x, loss_fn, steps=1, progress=False)
    finally:
        remat.remove(model)
    return m.peak_bytes


def test_side_output_is_neither_reused_nor_pinned(setup):
    _model, _x, prof = setup
    n = len(prof.block_profiles)
    assert all(bp.reused_bytes == 0 for bp in prof.block_profiles)
    assert all(bp.pinned_out_bytes == 0 for bp in prof.block_profiles[: n - 1])
    assert prof.is_chain
    aux = 256 * 64 * 16 * 4
    # freed in the gap after the next layer (the head's for the last two)
    assert [bp.dropped_output_frees for bp in prof.block_profiles] == [
        ((1, aux),),
        ((2, aux),),
        ((3, aux),),
        ((3, aux),),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "R[0:1](K0) R[1:2](K1) R[2:3](K2) R[3:4](K3)",  # full()
        "R[0:2](K0 K1) K2 K3",  # sqrt()
        "R[0:3](K0 K1 K2) K3",  # a replay over several such layers
        "R[0:3](R[0:1](K0) R[1:2](K1) K2) K3",
        "K0 K1 K2 K3",
    ],
)
def test_prediction_is_a_close_upper_bound(setup, text):
    model, x, prof = setup
    planner = importlib.import_module("remat.plan.planner")
    types_ = importlib.import_module("remat.plan.types")
    plan = planner.plan_from_ops(prof, types_.ops_from_text(text), "none")
    measured = _check(model, x, plan)
    ratio = measured / plan.predicted_peak_bytes
    assert 0.95 <= ratio <= 1.001, (text, measured, plan.predicted_peak_bytes)


def test_stated_minimum_is_reachable_and_met(setup):
    model, x, prof = setup
    with pytest.raises(BudgetInfeasibleError) as e:
        remat.plan(prof, budget="1%")
    full = _check(model, x, remat.plan(prof, strategy=remat.full()))
    assert e.value.min_peak_bytes <= full * 1.05, (e.value.min_peak_bytes, full)
    plan = remat.plan(prof, budget=e.value.min_peak_bytes)
    measured = _check(model, x, plan)
    assert measured <= plan.budget_bytes * 1.001, (plan.describe(), measured, plan.budget_bytes)
    assert measured >= 0.95 * plan.predicted_peak_bytes, (plan.describe(), measured, plan.predicted_peak_bytes)
