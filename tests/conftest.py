"""Tiny fixture models shared by the tests (seconds, not minutes, on 2 CPU cores)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.models import Workload, workload


class Tally:
    """A count in an object of its own without a ``__dict__``: a replay sets a block's plain attributes (ints,
    and lists of them) back to their values at the call (NOTE [ State under recomputation ]), and those of the
    plain objects its modules hold (NOTE [ Attributes other code sets ]), not a slotted object's."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class Counted(nn.Module):
    """A residual MLP block that counts how often its forward runs (recomputation included, in a
    :class:`Tally`: an int would count the plain model's calls only)."""

    def __init__(self, d: int, p: float = 0.1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.act = nn.GELU()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(2 * d, d)
        self.runs = Tally()

    @property
    def calls(self) -> int:
        return self.runs.n

    @calls.setter
    def calls(self, value: int) -> None:
        self.runs.n = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs.n += 1
        return x + self.fc2(self.drop(self.act(self.fc1(x))))


class TinyNet(nn.Module):
    """embed -> 5 Counted layers -> head; the layers are the default blocks."""

    def __init__(self, d: int = 16, n: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.layers = nn.ModuleList(Counted(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def tiny_net_workload(seed: int = 0) -> Workload:
    """A TinyNet with a batch and a loss."""
    torch.manual_seed(seed)
    model = TinyNet()
    x = torch.randn(6, 8)
    target = torch.randn(6, 4)
    return Workload("tiny", model, x, lambda out: torch.nn.functional.mse_loss(out, target), "TinyNet")


@pytest.fixture
def tiny() -> Workload:
    return tiny_net_workload()


@pytest.fixture
def small_gpt() -> Workload:
    return workload("gpt", n_layers=4, d_model=32, n_heads=2, seq_len=16, batch=2, vocab_size=64, dropout=0.1)


@pytest.fixture
def small_mlp() -> Workload:
    return workload("mlp", widths=(16, 64, 24, 96, 16, 48, 32, 128, 16), batch=32)


@pytest.fixture
def small_resnet() -> Workload:
    return workload("resnet", layers=(1, 1), width=8, image_size=16, batch=4)


def exact_peak(model: nn.Module, plan: Any, inputs: Any, loss_fn: Callable[[Any], torch.Tensor]) -> int:
    """The measured peak of one step of ``model`` under ``plan``, after checking its gradients are bitwise
    the plain model's; the model is left without the plan."""
    check = remat.check_gradients(model, plan, inputs, loss_fn)
    assert check.equal and check.exact, check.mismatched
    remat.apply(model, plan)
    try:
        return remat.measure(model, inputs, loss_fn, steps=1).peak_bytes
    finally:
        remat.remove(model)
