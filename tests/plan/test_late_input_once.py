"""F6: a late input taken by every block (a mask made before the blocks, freed when the forward returns) is
charged to every checkpoint by the solvers' tables, once by the simulation: a budget that remat's own full()
plan meets (predicted and measured) was refused with BudgetInfeasibleError."""

import copy

import pytest
import torch
from torch import nn

import remat

N, D, W = 256, 64, 8


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x + m[:, :D])))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer() for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.detach().repeat(1, W) * 0.1  # taken by every layer, saved by none
        for layer in self.layers:
            x = layer(x, m)
        return x


def _loss(o: torch.Tensor) -> torch.Tensor:
    return (o**2).mean()


def _run(model: nn.Module, plan: remat.Plan, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    m = copy.deepcopy(model)
    remat.apply(m, plan)
    peak = remat.measure(m, x, _loss, steps=1, progress=False).peak_bytes
    m.zero_grad(set_to_none=True)
    _loss(m(x)).backward()
    return peak, [p.grad for p in m.parameters()]


@pytest.mark.parametrize("solver", ["optimal", "knapsack"])
def test_budget_full_meets_is_planned(solver: str) -> None:
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(N, D)
    prof = remat.profile(model, x, _loss, repeats=1, ops=False, progress=False)
    assert prof.late_inputs
    full = remat.plan(prof, strategy="full()")
    full_measured, _ = _run(model, full, x)
    budget = int(max(full_measured, full.predicted_peak_bytes) * 1.02)
    plan = remat.plan(prof, budget=budget, solver=solver)  # before: BudgetInfeasibleError (smallest 2.70 MB)
    assert plan.predicted_peak_bytes <= budget
    measured, grads = _run(model, plan, x)
    assert measured <= budget
    ref = copy.deepcopy(model)
    _loss(ref(x)).backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, ref.parameters()))


def test_refusal_states_the_lowest_predicted_peak() -> None:
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(N, D)
    prof = remat.profile(model, x, _loss, repeats=1, ops=False, progress=False)
    full = remat.plan(prof, strategy="full()")
    with pytest.raises(remat.BudgetInfeasibleError) as info:
        remat.plan(prof, budget=prof.base_bytes + 1)
    assert info.value.min_peak_bytes <= full.predicted_peak_bytes
