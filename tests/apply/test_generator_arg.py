"""A generator handed to a recomputed block as an argument is restored for its replay on every call, not
only on the learning call (NOTE [ State under recomputation ] in remat.core.runtime)."""

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

    def forward(self, x: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        return y * (torch.rand(y.shape, generator=gen) > 0.3)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Blk() for _ in range(4)])

    def forward(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, gen=gen)
        return x


def _train(model):
    torch.manual_seed(0)
    grads, states = [], []
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)  # a fresh generator per step
        model.zero_grad(set_to_none=True)
        model(torch.randn(8, D), gen).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        states.append(gen.get_state())
    return grads, states


@pytest.mark.parametrize(
    "ops",
    [
        tuple(Recompute(i, i + 1, (Keep(i),)) for i in range(4)),
        (Recompute(0, 4, tuple(Keep(i) for i in range(4))),),
        (Recompute(0, 4, (Recompute(0, 2, (Keep(0), Keep(1))), Keep(2), Keep(3))),),
    ],
)
def test_a_fresh_generator_argument_per_step_is_replayed_exactly(ops):
    torch.manual_seed(1)
    plain = _Net()
    planned = copy.deepcopy(plain)
    remat.apply(planned, Plan("custom", remat.blocks(planned, include="layers.*"), ops))
    (ga, sa), (gb, sb) = _train(plain), _train(planned)
    for x, y in zip(ga, gb):
        assert all(torch.equal(u, v) for u, v in zip(x, y))
    assert all(torch.equal(u, v) for u, v in zip(sa, sb))  # each generator ends where the plain step left it
