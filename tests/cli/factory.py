"""A user's own model factory, loaded by the CLI as ``tests.cli.factory:make``."""

from __future__ import annotations

import torch
from torch import nn


def make(width: int = 8) -> tuple[nn.Module, torch.Tensor, object]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)])
    x = torch.randn(4, width)
    return model, x, lambda out: out.square().mean()


def broken() -> None:
    raise ValueError("boom")


def mismatched() -> tuple[nn.Module, torch.Tensor, object]:
    """Inputs that do not fit the model: the model itself raises when called."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    return model, torch.randn(2, 5), lambda out: out.sum()


def timing_env() -> None:
    """Reports the timing variables this process runs with, through the CLI's one error line."""
    import os

    raise ValueError(",".join(f"{k}={os.environ.get(k, 'unset')}" for k in ("OMP_WAIT_POLICY", "MALLOC_TOP_PAD_")))


class Model(nn.Module):
    """A model class, not a factory: ``tests/cli/factory.py:Model`` is refused with the fix."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)


def needs(width: int) -> tuple[nn.Module, torch.Tensor, object]:
    """A factory with a parameter that has no default."""
    return make(width)
