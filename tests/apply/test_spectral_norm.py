"""Spectral norm's power iteration updates its vectors in every training forward: remat restores them
around each recomputation, as a norm's running statistics, without ``allow_stateful`` (refused before,
so the planner kept every such block). Gradients and the vectors stay bitwise those of the plain model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

import remat


def _model(style: str) -> nn.Module:
    torch.manual_seed(0)

    def layer() -> nn.Module:
        lin = nn.Linear(32, 32)
        normed = spectral_norm(lin) if style == "parametrization" else torch.nn.utils.spectral_norm(lin)
        return nn.Sequential(normed, nn.Tanh(), nn.Linear(32, 32))

    return nn.Sequential(*(layer() for _ in range(4)))


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).mean()


@pytest.mark.parametrize("style", ["parametrization", "hook"])
def test_spectral_norm_blocks_are_recomputed_with_their_vectors_restored(style: str) -> None:
    x = torch.randn(64, 32)
    prof = remat.profile(_model(style), x, _loss, repeats=1, progress=False)
    assert not any(bp.stateful for bp in prof.block_profiles)
    try:
        plan = remat.plan(prof, "1%")
    except remat.BudgetInfeasibleError as e:
        plan = remat.plan(prof, e.min_peak_bytes)
    assert plan.predicted_peak_bytes < 0.95 * prof.peak_bytes, plan.describe()  # it recomputes something
    for how in (plan, remat.full(), remat.segments(2)):
        plain, planned = _model(style), _model(style)
        remat.apply(planned, how)
        for _ in range(2):
            for m in (plain, planned):
                _loss(m(x)).backward()
        assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), planned.buffers(), strict=True))
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), planned.parameters(), strict=True))
