"""Op-level policies on blocks that bind a computed tensor to a module (``torch.nn.utils.prune``).

NOTE [ Tensors the block's modules hold ] in ``remat/profile/ops.py``: prune's forward pre-hook sets
``module.weight = weight_orig * weight_mask``, held by the module past the backward. A policy recomputing
that ``mul`` freed nothing and its replay made a second copy: measured 1.08-1.21x the prediction.
"""

from __future__ import annotations

import torch
import torch.nn.utils.prune as prune
from torch import nn

import remat
from remat.errors import BudgetInfeasibleError
from remat.plan import Keep
from remat.plan.planner import plan_from_ops
from remat.plan.policies import op_costs

D = 32


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(nn.functional.gelu(self.fc1(x))))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_MLP() for _ in range(5)])
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _build() -> _Stack:
    torch.manual_seed(0)
    model = _Stack()
    for layer in model.layers:
        prune.l1_unstructured(layer.fc1, "weight", amount=0.5)
        prune.random_unstructured(layer.fc2, "weight", amount=0.3)
    return model


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def test_every_menu_policy_is_predicted() -> None:
    model, x = _build(), torch.randn(8, 8, D)
    prof = remat.profile(model, x, _loss, repeats=1)
    menu: dict[int, list[object]] = {}
    for k, op in op_costs(prof):
        menu.setdefault(k, []).append(op)
    assert all(k in menu for k in range(4))
    for j in range(max(len(v) for v in menu.values())):
        ops = tuple(menu[i][min(j, len(menu[i]) - 1)] for i in range(4)) + (Keep(4),)
        plan = plan_from_ops(prof, ops, "by hand")  # type: ignore[arg-type]
        remat.apply(model, plan)
        measured = remat.measure(model, x, _loss, steps=1).peak_bytes
        remat.remove(model)
        assert plan.predicted_peak_bytes is not None
        ratio = measured / plan.predicted_peak_bytes
        assert 0.95 <= ratio <= 1.05, (plan.describe(), measured, plan.predicted_peak_bytes)


def test_smallest_plan_holds_its_budget_and_is_bitwise() -> None:
    model, x = _build(), torch.randn(8, 8, D)
    prof = remat.profile(model, x, _loss, repeats=1)
    try:
        remat.plan(prof, "1B")
    except BudgetInfeasibleError as e:
        smallest = e.min_peak_bytes
    plan = remat.plan(prof, smallest)
    remat.apply(model, plan)
    measured = remat.measure(model, x, _loss, steps=1).peak_bytes
    assert measured <= 1.05 * smallest, (plan.describe(), measured, smallest)
    remat.remove(model)

    def grads(m: nn.Module) -> list[torch.Tensor]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            _loss(m(x)).backward()
        return [p.grad.clone() for p in m.parameters()]

    applied = _build()
    remat.apply(applied, plan)
    assert all(torch.equal(a, b) for a, b in zip(grads(_build()), grads(applied)))
