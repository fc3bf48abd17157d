"""A block that skips itself at random (stochastic depth decided inside it) runs other ops from forward to
forward: the per-op profile refuses it, and the message names the way out (``ops=False``), with which the
profile, the planner and ``apply`` work and the gradients are bitwise those of the plain model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.errors import RematError

D = 16


class _Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.rand(()) < 0.5:
            return x
        return x + torch.tanh(self.fc(x))


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_Skip() for _ in range(6)], nn.Linear(D, 1))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def test_refusal_names_ops_false_and_it_works() -> None:
    x = torch.randn(8, D)
    model = _build()
    with pytest.raises(RematError, match=r"ran different ops .*remat\.profile\(\.\.\., ops=False\)"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            remat.profile(model, x, _loss, repeats=1)
    prof = remat.profile(model, x, _loss, repeats=1, ops=False)
    plan = remat.plan(prof, strategy=remat.full())

    def grads(m: nn.Module) -> list[torch.Tensor | None]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            _loss(m(x)).backward()
        return [None if p.grad is None else p.grad.clone() for p in m.parameters()]

    applied = _build()
    remat.apply(applied, plan)
    plain, got = grads(_build()), grads(applied)
    assert [g is None for g in plain] == [g is None for g in got]
    assert all(a is None or torch.equal(a, b) for a, b in zip(plain, got))
