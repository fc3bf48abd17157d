"""The last block of a replay stops at its last saved tensor (NOTE [ The replay's last block stops early ] in
remat.plan.chain).

Blocks Dropout -> Linear -> SiLU -> ``* 2 + 1``: SiLU saves its input before it runs, so a replay ending with
the block stops there and never makes the three tensors after it. The simulator charged the block's whole
forward peak in the replay: ``full()`` measured 167712 bytes against a prediction of 189180 (0.887).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.plan.chain import chain_of
from remat.plan.planner import plan_from_ops
from tests.oracle import measured_bitwise

N, D, B = 4, 64, 64


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)  # draws: each segment keeps an RNG state of its own
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(self.lin(self.drop(x))) * 2.0 + 1.0


def _case(ops: bool):
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block() for _ in range(N)])
    x = torch.randn(B, D)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return y.square().mean()

    prof = remat.profile(model, (x,), loss_fn, repeats=1, progress=False, grads="held", ops=ops)
    return model, x, loss_fn, prof


@pytest.fixture(scope="module")
def case():
    return _case(ops=True)


def _measured(model, x, loss_fn, plan) -> int:
    return measured_bitwise(model, x, loss_fn, plan)


def test_the_stop_peak_leaves_out_what_follows_the_last_save(case) -> None:
    _, _, _, prof = case
    chain = chain_of(prof)
    out = B * D * 4
    for k in range(N):
        # silu's output, its * 2 and the + 1 never exist in the replay; the forward peak had two of them at once.
        assert chain.replay_fwd_peak_bytes[k] - chain.replay_stop_peak_bytes[k] >= 2 * out


@pytest.mark.parametrize("strategy", ["full", "by hand"])
def test_replays_ending_with_the_block_are_predicted(case, strategy) -> None:
    model, x, loss_fn, prof = case
    if strategy == "full":
        plan = remat.plan(prof, strategy="full")
    else:
        ops = (Recompute(0, 2, (Keep(0), Keep(1))), Keep(2), Recompute(3, 4, (Keep(3),)))
        plan = plan_from_ops(prof, ops, strategy)
    peak = _measured(model, x, loss_fn, plan)
    assert 0.97 * plan.predicted_peak_bytes <= peak <= 1.02 * plan.predicted_peak_bytes, (
        plan.describe(),
        peak,
        plan.predicted_peak_bytes,
    )


def test_without_the_op_profile_the_whole_peak_is_charged() -> None:
    model, x, loss_fn, prof = _case(ops=False)
    chain = chain_of(prof)
    assert chain.replay_stop_peak_bytes == chain.replay_fwd_peak_bytes
    plan = remat.plan(prof, strategy="full")
    assert _measured(model, x, loss_fn, plan) <= plan.predicted_peak_bytes
