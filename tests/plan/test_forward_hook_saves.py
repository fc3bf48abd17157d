"""A forward hook of the model's on a block (``relu(out) + x``) runs outside the block's forward, which is all
a replay runs again: what it saves is held whatever the plan, and its ops are none of the block's
(NOTE [ Forward hooks run outside the block ] in ``remat.profile.profiler``). Counted as the block's own,
plans measured 1.12-1.15x their prediction and budget, and an op-level policy cached the hook's relu."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import remat
from remat.errors import BudgetInfeasibleError


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.layers = nn.ModuleList(_Layer() for _ in range(6))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _hook(_mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
    return torch.relu(out) + args[0] * 0.1  # relu saves its output: held by the graph whatever the plan


def _case() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = _Net()
    for layer in model.layers[1:3]:
        layer.register_forward_hook(_hook)
    return model, torch.randn(512, 8)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


@pytest.fixture(scope="module")
def prof() -> remat.Profile:
    model, x = _case()
    return remat.profile(model, x, _loss, repeats=1)


def _smallest(prof: remat.Profile) -> int:
    with pytest.raises(BudgetInfeasibleError) as info:
        remat.plan(prof, budget="1B")
    return info.value.min_peak_bytes


@pytest.mark.parametrize("which", ["full", "smallest"])
def test_hook_saves_are_charged(prof: remat.Profile, which: str, caplog: pytest.LogCaptureFixture) -> None:
    plan = remat.plan(prof, strategy=remat.full()) if which == "full" else remat.plan(prof, budget=_smallest(prof))
    assert plan.predicted_peak_bytes is not None
    model, x = _case()
    check = remat.check_gradients(model, plan, x, _loss)
    assert check.equal and check.exact
    remat.apply(model, plan)
    with caplog.at_level(logging.WARNING):
        measured = remat.measure(model, x, _loss, steps=1, progress=False).peak_bytes
    assert measured <= 1.05 * plan.predicted_peak_bytes
    if plan.budget_bytes is not None:
        assert measured <= 1.05 * plan.budget_bytes
    # No op-level policy caches an op of the hook, which its recomputation never runs.
    assert not [r for r in caplog.records if "did not run" in r.getMessage()]


def test_hook_ops_are_not_the_blocks(prof: remat.Profile) -> None:
    # The hooked blocks run the same ops as the others: the hook's relu and add are the model's code.
    names = [[op.name for op in ops.ops] for ops in prof.block_ops]
    assert names[1] == names[2] == names[0]
