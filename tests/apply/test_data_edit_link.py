"""An earlier member's output edited in place through ``.data`` (no version bump) before the next member
takes it: refused on the learning call, not replayed with the unedited values (NOTE [ Edits of a member's
output through .data ] in ``remat.core.runtime``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.errors import RematError
from remat.plan.types import Plan

D = 16


class _Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * 2.0


class _Net(nn.Module):
    def __init__(self, edit: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Blk() for _ in range(4)])
        self.edit = edit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if self.edit == "data_inplace":
                x.data.clamp_(-0.5, 0.5)  # autograd does not see it
            elif self.edit == "data_rebound":
                x.data = x.data.clamp(-0.5, 0.5)
            elif self.edit == "no_grad_inplace":
                with torch.no_grad():
                    x.clamp_(-0.5, 0.5)  # bumps the version: no link
        return x


SEGMENT = (Recompute(0, 4, tuple(Keep(i) for i in range(4))),)


def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    xi = x.detach().clone().requires_grad_(True)
    model(xi).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [xi.grad.clone()]


@pytest.mark.parametrize("edit", ["data_rebound", "no_grad_inplace"])
def test_edits_autograd_or_remat_sees_give_the_plain_gradients(edit: str) -> None:
    torch.manual_seed(0)
    plain = _Net(edit)
    planned = copy.deepcopy(plain)
    x = torch.randn(8, D)
    remat.apply(planned, Plan("custom", remat.blocks(planned, include="layers.*"), SEGMENT))
    assert all(torch.equal(a, b) for a, b in zip(grads(plain, x), grads(planned, x)))


def test_an_output_edited_through_data_before_the_next_member_is_refused() -> None:
    torch.manual_seed(0)
    planned = _Net("data_inplace")
    remat.apply(planned, Plan("custom", remat.blocks(planned, include="layers.*"), SEGMENT))
    with pytest.raises(
        RematError, match=r"output of module 'layers.0' \(shape \(8, 16\)\) was edited before module 'layers.1'"
    ):
        grads(planned, torch.randn(8, D))
