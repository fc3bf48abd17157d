"""A block output the parent drops (``h, aux = layer(h)``, aux unused): the plain step frees what the aux
branch saved in the *next* block's gap (BlockProfile.dead_saved_frees); a plan recomputing the first block
never saved it, so the kept next block must not credit that free again (h72's repro measured 1.15x the
budget). The chain charges the free to the block itself (remat.plan.chain._dropped with dead=True), and the
simulator charges a dead branch to the forwards it spans only where its block runs kept in the same forward
(Chain.dead_branches: a replay holds the branches of the blocks it replays kept, no gap drops them there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.plan.planner import plan_from_ops
from remat.plan.solver import all_plans
from remat.plan.types import ops_from_text
from remat.profile import Profile

D = 24
B = 2 * 128 * D * 4  # one (2, 128, 24) float tensor


class _Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(D)
        self.aux_head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        return x, self.aux_head(x).squeeze(-1)  # saves a contiguous copy of x


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.layers = nn.ModuleList([_Blk() for _ in range(4)])
        self.head = nn.Linear(D, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h, _aux = layer(h)  # the aux output is dropped when the next call rebinds it
        return self.head(h)


def _step(model: nn.Module, x: torch.Tensor, loss_fn) -> tuple[dict, dict]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    loss_fn(model(x)).backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return grads, {n: b.clone() for n, b in model.named_buffers()}


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model = _Net()
    x, tgt = torch.randn(2, 128, 5), torch.randn(2, 128, 7)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(y, tgt)

    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref = _step(model, x, loss_fn)
    model.load_state_dict(state)
    prof = remat.profile(model, x, loss_fn, repeats=1, progress=False, ops=False)
    model.load_state_dict(state)
    return model, x, loss_fn, state, ref, prof


def test_the_profile_finds_the_dead_branch(case) -> None:
    *_, prof = case
    bps = prof.block_profiles
    # Blocks 0..2's aux branches are freed in the next block's gap (block 2's when the last call returns, in
    # the head), block 3's in the head; each saved one contiguous (2, 128, 24) float copy.
    assert [bp.dead_saved_frees for bp in bps] == [((1, B),), ((2, B),), ((3, B),), ((3, B),)]
    # The head frees block 2's branch before its peak (the rebinding), block 3's after it (the return).
    assert [bp.dead_head_late_bytes for bp in bps] == [0, 0, 0, B]
    assert all(bp.bwd_level_bytes is not None for bp in bps)
    assert Profile.from_json(prof.to_json()).block_profiles == bps


def test_dead_block_output_plan_keeps_its_budget(case) -> None:
    model, x, loss_fn, state, (ref_g, ref_b), prof = case
    with pytest.raises(remat.BudgetInfeasibleError) as e:
        remat.plan(prof, budget="1B")
    plan = remat.plan(prof, budget=e.value.min_peak_bytes)
    remat.apply(model, plan)
    try:
        g, b = _step(model, x, loss_fn)
        model.load_state_dict(state)
        m = remat.measure(model, x, loss_fn, steps=1, warmup=1, progress=False)
    finally:
        remat.remove(model)
        model.load_state_dict(state)
    assert all((ref_g[n] is None and g[n] is None) or torch.equal(ref_g[n], g[n]) for n in ref_g)
    assert all(torch.equal(ref_b[n], b[n]) for n in ref_b)
    # Main measured 186056 bytes against a budget and prediction of 161280 (1.154x).
    assert m.peak_bytes <= plan.budget_bytes * 1.05
    assert plan.predicted_peak_bytes * 0.95 <= m.peak_bytes <= plan.predicted_peak_bytes * 1.05


# Before: main under-predicted the first six by 1.06-1.38x (R[0:4](K0 K1 K2 K3) 1.203: a replay holds the dead
# branches of the blocks it replays, and runs above what the head keeps), h76's first port the nested one 1.168.
@pytest.mark.parametrize(
    "text",
    [
        "R[0:1](K0) K1 K2 K3",
        "R[0:2](K0 K1) K2 K3",
        "R[0:4](R[0:2](K0 K1) K2 K3)",
        "R[0:4](K0 K1 K2 K3)",
        "R[0:4](R[0:1](K0) K1 K2 K3)",
        "R[0:1](K0) R[1:4](R[1:2](K1) K2 K3)",
        "K0 K1 K2 K3",
        "K0 R[1:2](K1) K2 K3",
        "K0 K1 R[2:3](K2) K3",
        "K0 K1 K2 R[3:4](K3)",
        "R[0:2](R[0:1](K0) K1) K2 K3",
    ],
)
def test_plans_over_dead_branches_are_predicted(case, text: str) -> None:
    model, x, loss_fn, state, (ref_g, ref_b), prof = case
    plan = plan_from_ops(prof, ops_from_text(text), "by hand")
    remat.apply(model, plan)
    try:
        g, b = _step(model, x, loss_fn)
        model.load_state_dict(state)
        m = remat.measure(model, x, loss_fn, steps=1, warmup=1, progress=False)
    finally:
        remat.remove(model)
        model.load_state_dict(state)
    assert all((ref_g[n] is None and g[n] is None) or torch.equal(ref_g[n], g[n]) for n in ref_g)
    assert all(torch.equal(ref_b[n], b[n]) for n in ref_b)
    assert plan.predicted_peak_bytes * 0.95 <= m.peak_bytes <= plan.predicted_peak_bytes * 1.05, text


def test_no_plan_runs_over_its_prediction(case) -> None:
    """Every plan of the four blocks: never more than 5% over its prediction (the solvers' budgets)."""
    model, x, loss_fn, state, _, prof = case
    over = []
    for ops in all_plans(4):
        plan = plan_from_ops(prof, ops, "all")
        remat.apply(model, plan)
        try:
            m = remat.measure(model, x, loss_fn, steps=1, warmup=1, progress=False)
        finally:
            remat.remove(model)
            model.load_state_dict(state)
        if m.peak_bytes > plan.predicted_peak_bytes * 1.05:
            over.append((plan.describe(), plan.predicted_peak_bytes, m.peak_bytes))
    assert not over
