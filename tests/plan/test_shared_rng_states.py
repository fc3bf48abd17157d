"""Consecutive top-level segments share one CPU RNG state (NOTE [ Shared RNG states ] in remat.plan.solver).

The runtime keeps one state for every single-block segment that follows another with nothing drawn between
them; the simulator charged ``ckpt_state_bytes`` per segment: six Linear + Tanh blocks under ``full()`` with
held gradients measured 28552 bytes against a prediction of 53832 (0.530), five states too many.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.plan.chain import chain_of
from remat.plan.planner import plan_from_ops
from remat.plan.solver import simulate
from tests.oracle import measured_bitwise

N, D, B = 6, 32, 16


class _Block(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.drop = nn.Dropout(p) if p else nn.Identity()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(self.drop(x)))  # tanh saves its output: the replay runs to the block's end


def _case(p: float):
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(p) for _ in range(N)])
    x = torch.randn(B, D)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return y.square().mean()

    prof = remat.profile(model, (x,), loss_fn, repeats=1, progress=False, grads="held")
    return model, x, loss_fn, prof


@pytest.fixture(scope="module")
def plain():
    return _case(0.0)


@pytest.fixture(scope="module")
def drawing():
    return _case(0.1)


def _measured(model, x, loss_fn, plan) -> int:
    return measured_bitwise(model, x, loss_fn, plan)


def test_full_is_predicted_with_one_shared_state(plain) -> None:
    model, x, loss_fn, prof = plain
    plan = remat.plan(prof, strategy="full")
    peak = _measured(model, x, loss_fn, plan)
    assert 0.98 * plan.predicted_peak_bytes <= peak <= 1.02 * plan.predicted_peak_bytes, (
        peak,
        plan.predicted_peak_bytes,
    )


def test_a_segment_after_several_blocks_keeps_its_own_state(plain) -> None:
    # The last call of a multi-block segment drops the shared reference: the next segment copies the state.
    model, x, loss_fn, prof = plain
    ops = (Recompute(0, 2, (Keep(0), Keep(1))),) + tuple(Recompute(k, k + 1, (Keep(k),)) for k in range(2, N))
    plan = plan_from_ops(prof, ops, "by hand")
    peak = _measured(model, x, loss_fn, plan)
    assert 0.98 * plan.predicted_peak_bytes <= peak <= 1.02 * plan.predicted_peak_bytes


def test_blocks_that_draw_keep_a_state_each(drawing) -> None:
    model, x, loss_fn, prof = drawing
    chain = chain_of(prof)
    assert all(chain.rng_draws[:N])
    plan = remat.plan(prof, strategy="full")
    peak = _measured(model, x, loss_fn, plan)
    assert 0.95 * plan.predicted_peak_bytes <= peak <= 1.02 * plan.predicted_peak_bytes


def test_without_the_op_profile_every_segment_is_charged(plain) -> None:
    _, _, _, prof = plain
    chain = chain_of(prof)
    assert not any(chain.rng_draws[:N])
    ops = tuple(Recompute(k, k + 1, (Keep(k),)) for k in range(N))
    shared = simulate(chain, ops).peak_bytes
    unknown = simulate(dataclasses.replace(chain, rng_draws=()), ops).peak_bytes
    # Peaking in the last segment's replay, every earlier segment's checkpoint open: N - 1 states fewer.
    assert unknown - shared == (N - 1) * chain.ckpt_state_bytes
