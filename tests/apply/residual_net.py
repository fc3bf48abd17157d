"""A six-layer residual MLP the hook and warning tests share: ``ResidualNet`` of ``ResidualMLP`` layers, and its loss."""

from __future__ import annotations

import torch
from torch import nn


class ResidualMLP(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class ResidualNet(nn.Module):
    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(8, 32), nn.Linear(32, 4)
        self.layers = nn.ModuleList(ResidualMLP() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def squared_loss(y: torch.Tensor) -> torch.Tensor:
    return (y**2).mean()
