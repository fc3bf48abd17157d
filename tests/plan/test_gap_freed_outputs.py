"""A block's own output that the code after it frees, the next block not taking it (``l(x, x)`` split
into ``fc`` and ``g``): a segment going on past the block holds that code's allocation whole
(BlockProfile.gap_freed_output_bytes, NOTE [ Chain cost model ])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Op, Recompute
from remat.plan.planner import plan_from_ops
from remat.profile import Profile

D, N, L = 64, 128, 4


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.g = nn.Linear(D, D)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # tanh saves its result and drops fc's output, in the code between the blocks fc and g.
        return a + torch.tanh(self.fc(a)) * torch.sigmoid(self.g(b))


class _SameTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Two() for _ in range(L))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, x)
        return x


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).mean()


@pytest.fixture(scope="module")
def split() -> tuple[_SameTwice, torch.Tensor, Profile]:
    torch.manual_seed(0)
    model, x = _SameTwice(), torch.randn(N, D, requires_grad=True)
    return model, x, remat.profile(model, x, _loss, blocks=remat.blocks(model, split=True), repeats=1)


def test_the_profile_finds_the_output_the_gap_frees(split) -> None:
    _, _, prof = split
    out = N * D * 4
    # Each fc's output is freed by tanh (which saves its result) before g starts, each g's by sigmoid
    # before the next fc starts; the last block's gap is the head's.
    assert [bp.gap_freed_output_bytes for bp in prof.block_profiles] == [out] * (2 * L - 1) + [0]
    assert Profile.from_json(prof.to_json()).block_profiles == prof.block_profiles


def _layers(segment: list[int], n: int) -> tuple[Op, ...]:
    ops: list[Op] = []
    for k in range(n // 2):
        a = 2 * k
        ops += [Recompute(a, a + 2, (Keep(a), Keep(a + 1)))] if k in segment else [Keep(a), Keep(a + 1)]
    return tuple(ops)


@pytest.mark.parametrize("segment", [[0], [L - 1], list(range(L)), [1, 2]], ids=str)
def test_segments_over_a_layer_s_two_children_are_predicted(split, segment: list[int]) -> None:
    model, x, prof = split
    plan = plan_from_ops(prof, _layers(segment, 2 * L), "by hand")
    remat.apply(model, plan)
    try:
        measured = remat.measure(model, x, _loss, steps=1).peak_bytes
    finally:
        remat.remove(model)
    # Measured 1.03-1.19x the prediction before (the gap's tanh output counted as freed); now exact on
    # the first layers, 3% above on later ones (the safe side: the replay of a segment is charged the
    # gap's allocations again, which the segment holds already).
    assert 0.96 * plan.predicted_peak_bytes <= measured <= plan.predicted_peak_bytes
