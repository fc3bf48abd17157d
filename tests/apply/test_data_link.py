"""An earlier member's output whose ``.data`` the model's code sets before the next member takes it is no
link: the replay hands that member the tensor the forward gave it."""

import copy

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.plan.types import Plan

D = 16


class _Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Blk() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](x)
        h.data = h.data.clamp(-0.2, 0.2)
        for layer in self.layers[1:]:
            h = layer(h)
        return h


@pytest.mark.parametrize(
    "ops",
    [
        (Recompute(0, 4, tuple(Keep(i) for i in range(4))),),
        (Recompute(0, 4, (Recompute(0, 2, (Keep(0), Keep(1))), Keep(2), Keep(3))),),
    ],
)
def test_an_output_whose_data_is_set_between_two_members_is_no_link(ops):
    torch.manual_seed(0)
    plain = _Net()
    planned = copy.deepcopy(plain)
    x = torch.randn(4, D, requires_grad=True)
    remat.apply(planned, Plan("custom", remat.blocks(planned, include="layers.*"), ops))
    grads = []
    for model in (plain, planned):
        xi = x.detach().clone().requires_grad_(True)
        model(xi).pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()] + [xi.grad])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
