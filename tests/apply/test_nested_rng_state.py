"""NOTE [ One RNG state per segment ] (remat/core/runtime.py): a nested checkpoint that starts at the third
member of a segment or later shares the segment's RNG state (no draws in between); it held a fresh 5056-byte
copy that no cost model charges (fuzz seed 366 whole/min: 1.168x its budget)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.core.ops import Keep as K
from remat.core.ops import Recompute as R
from remat.plan.planner import plan_from_ops


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(torch.cat([x, x], -1)))


class _Net(nn.Module):
    def __init__(self, d: int = 8, n: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(d) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


@pytest.mark.parametrize(
    ("ops", "tight"),
    [
        # 28712 vs 24712 predicted (1.162x) before; 23656 (0.957) after.
        ((R(0, 4, (K(0), K(1), R(2, 3, (K(2),)), K(3))), *(K(i) for i in range(4, 8))), True),
        # The shape of fuzz seed 366's plan: 40744 vs 32776 (1.243x) before; 30632 (0.935) after, below by a
        # separate charge on the safe side, so the +-5% check is left to the first case.
        (
            (R(0, 6, (R(0, 2, (K(0), K(1))), R(2, 4, (R(2, 3, (K(2),)), K(3))), R(4, 5, (K(4),)), K(5))), K(6), K(7)),
            False,
        ),
    ],
    ids=["third-member", "seed366-shape"],
)
def test_nested_checkpoint_shares_the_rng_state(ops: tuple, tight: bool) -> None:
    torch.manual_seed(0)
    model = _Net()
    x, tgt = torch.randn(2, 8, 8), torch.randn(2, 8, 1)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, tgt)

    prof = remat.profile(model, (x,), loss_fn, repeats=1, progress=False)
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    plan = plan_from_ops(prof, ops, "nested")
    budget = plan.predicted_peak_bytes
    remat.apply(model, plan)
    try:
        m = remat.measure(model, (x,), loss_fn, steps=1, warmup=1, progress=False)
        model.zero_grad(set_to_none=True)
        loss_fn(model(x)).backward()
        for k, p in model.named_parameters():
            assert torch.equal(ref[k], p.grad), k
    finally:
        remat.remove(model)
    assert m.peak_bytes <= budget * 1.05, (m.peak_bytes, budget)
    if tight:
        assert abs(m.peak_bytes / plan.predicted_peak_bytes - 1) <= 0.05, (m.peak_bytes, plan.predicted_peak_bytes)
