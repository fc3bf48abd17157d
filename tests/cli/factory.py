"""A user's own model factory, loaded by the CLI as ``tests.cli.factory:make``."""

from __future__ import annotations

import torch
from torch import nn


def make(width: int = 8) -> tuple[nn.Module, torch.Tensor, object]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)])
    x = torch.randn(4, width)
    return model, x, lambda out: out.square().mean()
