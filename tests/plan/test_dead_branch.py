"""What a block's forward saves on a branch that dies before the block returns is not held: op-level
policies are not credited with freeing it (NOTE [ Storages, not tensors ] in remat/profile/ops.py)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import remat


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        stat = h.abs().mean()  # computed with autograd on, never used (a logged statistic): its graph dies here
        del stat
        return torch.tanh(torch.tanh(h))


def test_a_dead_branch_saves_nothing_a_policy_could_free_and_plans_keep_their_budget() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(_Layer() for _ in range(8)))
    x = torch.randn(512, 32, requires_grad=True)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).sum()

    prof = remat.profile(model, (x,), loss_fn, repeats=1, progress=False)
    for bo in prof.block_ops:
        abs_ops = [op for op in bo.ops if op.name == "abs"]
        assert abs_ops and all(op.saved_bytes == 0 for op in abs_ops), abs_ops
    try:
        remat.plan(prof, "1KiB")
    except remat.BudgetInfeasibleError as e:
        smallest = e.min_peak_bytes
    for budget in ("50%", smallest):
        plan = remat.plan(prof, budget)
        planned = copy.deepcopy(model)
        remat.apply(planned, plan)
        peak = remat.measure(planned, (x,), loss_fn, steps=1, progress=False).peak_bytes
        assert peak <= 1.05 * plan.budget_bytes, (budget, plan.describe(), peak / plan.budget_bytes)
