"""NOTE [ A returned output edited after the block ]: the menu caches no returned tensor that autograd does not
save, so a model that edits it in place after the block trains under every menu policy."""

from __future__ import annotations

import copy

import torch
from torch import nn

import remat
from remat.core.ops import Keep, RecomputeOps
from remat.plan.policies import policy_menu
from remat.plan.types import Plan

D = 32


class _B(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x) + 1.0
        return y, y.exp() * torch.sigmoid(y) * 2.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b0, self.b1, self.fc, self.head = _B(), _B(), nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, e = self.b0(x)
        y, e = self.b1(y + e)
        y.mul_(0.5)  # edits the returned tensor in place, after the block
        return self.head(self.fc(y) * e.sum(-1, keepdim=True))


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_no_menu_policy_caches_a_returned_tensor_that_autograd_does_not_save() -> None:
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(64, D)
    plain = _grads(copy.deepcopy(model), x)
    prof = remat.profile(model, x, lambda y: y.square().mean(), repeats=1)
    for i, b in enumerate(prof.block_ops):
        menu = policy_menu(b)
        assert menu and all("add#0" not in p.save for p in menu)  # add#0 made the returned y
        for p in menu:
            ops = tuple(RecomputeOps(j, p.save, p.freed) if j == i else Keep(j) for j in range(2))
            remat.apply(model, Plan(strategy="by hand", blocks=prof.blocks, ops=ops))
            assert all(torch.equal(a, g) for a, g in zip(plain, _grads(model, x))), p.save
            remat.remove(model)
