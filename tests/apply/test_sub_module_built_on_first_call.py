"""A block whose own forward replaces a sub-module on its first call (a lazily built layer, HF BigBird's
attention swap) is refused in the backward: the replay would run another module than the forward did. The
message names the fix that works there, calling the model once before ``remat.apply``, and that fix gives the
plain model's gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat


class _Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.built = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.built:  # replaced on the first call, as a lazily built layer is
            self.inner = nn.Linear(8, 8)
            self.built = True
        return torch.tanh(self.inner(x))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Lazy() for _ in range(3)])


def test_the_refusal_names_calling_the_model_once_before_apply() -> None:
    model, x = _model(), torch.randn(4, 8)
    remat.apply(model, remat.full())
    with pytest.raises(remat.RematError, match="call the model once before remat.apply"):
        model(x).sum().backward()


def test_calling_once_before_apply_gives_the_plain_gradients() -> None:
    plain, x = _model(), torch.randn(4, 8)
    plain(x)  # builds the layers
    planned = copy.deepcopy(plain)
    remat.apply(planned, remat.full())
    for model in (plain, planned):
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), planned.parameters()):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), name
