"""A model that loops over (or indexes) an nn.Sequential of unlike layers instead of calling it: remat.blocks
gives the Sequential's children as blocks (as a ModuleList's), so the model profiles, a 50% plan is found,
measures within its budget and its prediction, and gives bitwise-equal gradients (the profile refused the
Sequential itself: it never ran). A Sequential the forward calls stays one block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.errors import BlockSelectionError


class A(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.out, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.out(F.gelu(self.fc(x))))


class B(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class C(A):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(x)))


class Net(nn.Module):
    """Unlike layers (no stack, no repeating pattern) in an nn.Sequential; the forward calls it."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.Sequential(A(d), B(d), C(d), B(d), A(d), C(d))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


class Looped(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Indexed(Net):
    """Reaches the layers through a method of its own."""

    def _block(self, i: int) -> nn.Module:
        return self.blocks[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i in range(len(self.blocks)):
            x = self._block(i)(x)
        return self.head(x)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks in both runs
    _loss(model(x)).backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("cls", [Looped, Indexed])
def test_a_sequential_looped_over_gives_its_children(cls: type[Net]) -> None:
    torch.manual_seed(0)
    model = cls()
    assert [b.name for b in remat.blocks(model)] == ["inp", *(f"blocks.{i}" for i in range(6)), "head"]
    x = torch.randn(256, 8)
    prof = remat.profile(model, x, _loss, repeats=1, progress=False)
    plan = remat.plan(prof, budget="50%")
    assert plan.budget_bytes is not None and plan.predicted_peak_bytes <= plan.budget_bytes
    plain = _grads(model, x)
    remat.apply(model, plan)
    try:
        got = _grads(model, x)
        measured = remat.measure(model, x, _loss, steps=1, warmup=1, progress=False).peak_bytes
    finally:
        remat.remove(model)
    assert plain.keys() == got.keys() and all(torch.equal(plain[n], got[n]) for n in plain)
    assert measured <= 1.05 * plan.budget_bytes, (measured, plan.budget_bytes)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes, (
        measured,
        plan.predicted_peak_bytes,
    )


def test_a_sequential_the_forward_calls_stays_one_block() -> None:
    torch.manual_seed(0)
    assert [b.name for b in remat.blocks(Net())] == ["inp", "blocks", "head"]


@pytest.mark.parametrize("ops", [True, False])
def test_choosing_a_looped_sequential_names_its_children(ops: bool) -> None:
    torch.manual_seed(0)
    model = Looped()
    chosen = remat.blocks(model, include=["inp", "blocks", "head"])
    with pytest.raises(BlockSelectionError, match=r"'blocks' is an nn.Sequential.*include='blocks\.\*'"):
        remat.profile(model, torch.randn(16, 8), _loss, blocks=chosen, repeats=1, progress=False, ops=ops)
