"""A backward with ``create_graph=True`` through recomputed blocks with BatchNorm (MAML's inner step, a
Hessian-vector product), followed by another forward and backward: the replay's own graph must not
hold buffers that a later replay edits (NOTE [ Buffers of a replay under create_graph ])."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import remat


def _model(training: bool) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()) for _ in range(3)])
    return m.train(training)


def _x() -> torch.Tensor:
    return torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))


def _maml(m: nn.Module) -> list[torch.Tensor]:
    x = _x()
    params = dict(m.named_parameters())
    inner = m(x).square().mean()
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {k: p - 0.01 * g for (k, p), g in zip(params.items(), grads)}
    functional_call(m, fast, (x,)).square().mean().backward()
    return [p.grad for p in m.parameters()] + list(m.buffers())


def _penalty_after_a_step(m: nn.Module) -> list[torch.Tensor]:
    # A gradient-norm penalty whose graph outlives another forward and backward of the model.
    params = list(m.parameters())
    grads = torch.autograd.grad(m(_x()).square().mean(), params, create_graph=True)
    m(_x() + 1).mean().backward()
    sum(g.square().sum() for g in grads).backward()
    return [p.grad for p in params] + list(m.buffers())


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("loop", [_maml, _penalty_after_a_step], ids=["maml", "penalty_after_a_step"])
@pytest.mark.parametrize("strategy", [remat.full(), remat.every_nth(2)], ids=["full", "every_2nd"])
def test_second_order_then_another_replay_matches_plain(training, loop, strategy) -> None:
    expected = loop(_model(training))
    model = _model(training)
    remat.apply(model, strategy)
    got = loop(model)
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
