"""Model code that wraps its ops in ``except Exception`` and raises its own error (einx, which x-transformers
uses for its masks): the early stop of a recomputation must not surface as that error."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, RecomputeOps
from remat.plan.types import Plan


class LibError(RuntimeError):
    pass


def lib_where(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What einx.where does: run the op, wrap any failure in an error of the library's own."""
    try:
        return torch.where(mask, x, torch.zeros((), dtype=x.dtype))
    except Exception as e:
        raise LibError("the operation failed") from e


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # The last op that saves (where saves its mask) runs inside the wrapper: the replay stops there.
        return lib_where(mask[..., None], torch.tanh(self.fc(x))) + x


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Masked() for _ in range(3)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return x


def _grads(model: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    model(x, mask).pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("how", ["segments", "policies"])
def test_a_stop_wrapped_in_the_models_own_error_still_stops_the_replay(how: str) -> None:
    torch.manual_seed(0)
    plain = Stack()
    x = torch.randn(2, 8, 16)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False
    model = copy.deepcopy(plain)
    if how == "segments":
        remat.apply(model, remat.full())  # remat's own replay (before: LibError from remat's stop signal)
    else:  # torch's selective checkpoint (before: LibError from torch's _StopRecomputationError)
        ops = (RecomputeOps(0, ()), RecomputeOps(1, ("addmm#0",)), Keep(2))
        remat.apply(model, Plan(strategy="by hand", blocks=tuple(remat.blocks(model)), ops=ops))
    for _ in range(2):
        for a, b in zip(_grads(model, x, mask), _grads(plain, x, mask)):
            assert torch.equal(a, b)
