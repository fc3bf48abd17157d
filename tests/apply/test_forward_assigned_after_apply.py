"""A ``module.forward = fn`` after ``remat.apply`` replaces remat's forward (NOTE [ A forward assigned after
apply ] in ``remat.core.runtime``): a RematError on the next forward, not an unplanned step."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import remat
from remat.errors import RematError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def scaled(self: Block, x: torch.Tensor, alpha: float, calls: list[str] | None = None) -> torch.Tensor:
    if calls is not None:  # not an attribute of the block: remat keeps those as at the call in a replay
        calls.append(type(self).__name__)
    return x + alpha * self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, rebind: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.rebind = rebind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.rebind:  # binds a fresh partial on every call, as some models bind closures
                layer.forward = functools.partial(scaled, layer, alpha=0.5)
            x = layer(x)
        return x


def grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (model(x) ** 2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assign(model: Net, calls: list[str] | None = None) -> None:
    for layer in model.layers:
        layer.forward = functools.partial(scaled, layer, alpha=0.5, calls=calls)


def test_a_forward_assigned_before_apply_is_the_one_recomputed() -> None:
    torch.manual_seed(0)
    plain, x = Net(), torch.randn(8, 16)
    model = copy.deepcopy(plain)
    plain_calls: list[str] = []
    calls: list[str] = []
    assign(plain, plain_calls)
    assign(model, calls)
    expected = grads(plain, x)
    remat.apply(model, remat.full())
    got = grads(model, x)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert len(calls) == 2 * len(plain_calls) == 8  # each layer's assigned forward ran again in the backward


def test_a_forward_assigned_after_apply_is_a_remat_error() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    remat.apply(model, remat.full())
    grads(model, x)
    assign(model)
    with pytest.raises(RematError, match=r"module 'layers.0' had its forward assigned after remat.apply"):
        grads(model, x)


def test_a_model_that_assigns_forwards_on_every_call_is_a_remat_error() -> None:
    torch.manual_seed(0)
    model, x = Net(rebind=True), torch.randn(8, 16)
    remat.apply(model, remat.full())
    with pytest.raises(RematError, match=r"had its forward assigned after remat.apply \(module.forward = partial\)"):
        grads(model, x)
