"""NOTE [ Fewer plain iterations for twins ]: how many plain iterations the profile times."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep
from remat.profile import profiler


class Layer(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def _count_plain(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    original = profiler._timed_step

    def step(it: Any, block_list: Any, members: Any, ops: Any, dev: Any, reuse: Any) -> Any:
        seen.append("plain" if all(isinstance(op, Keep) for op in ops) else "checkpointed")
        return original(it, block_list, members, ops, dev, reuse)

    monkeypatch.setattr(profiler, "_timed_step", step)
    return seen


def _profile(layers: list[nn.Module], repeats: int) -> remat.Profile:
    # A stem first: every layer's input requires grad, so the first layer's backward FLOPs are its twins'.
    model = nn.Sequential(nn.Linear(32, 32), *layers)
    x = torch.randn(8, 32)
    return remat.profile(model, x, lambda y: y.pow(2).mean(), blocks=remat.blocks(model, types=Layer), repeats=repeats)


@pytest.mark.parametrize(("repeats", "plain"), [(1, 1), (2, 2), (3, 2), (5, 2), (9, 3)])
def test_twins_only_time_fewer_plain_iterations(monkeypatch: pytest.MonkeyPatch, repeats: int, plain: int) -> None:
    # Four twins: ceil(repeats / 4) plain iterations, at least two, at most ``repeats``.
    seen = _count_plain(monkeypatch)
    torch.manual_seed(0)
    prof = _profile([Layer() for _ in range(4)], repeats)
    assert seen.count("plain") == plain
    # The pooled times are one value per group (NOTE [ Twin blocks ]), measured.
    assert len({bp.fwd_ms for bp in prof.block_profiles}) == 1
    assert prof.block_profiles[0].fwd_ms > 0


def test_a_block_without_a_twin_keeps_every_plain_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count_plain(monkeypatch)
    torch.manual_seed(0)
    odd = Layer()
    odd.fc = nn.Linear(32, 32, bias=False)  # other parameters: no twin
    _profile([Layer(), Layer(), Layer(), odd], 3)
    assert seen.count("plain") == 3
