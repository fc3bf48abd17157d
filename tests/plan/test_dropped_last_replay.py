"""The last block's output dropped in the head (BlockProfile.dropped_output_frees with after == n - 1): a
BatchNorm layer returns a transposed view, the head's Linear saves a contiguous copy of it (not the
output), and the head's rebinding frees the output in the forward. The chain frees it right after the block
(x_bytes[n] = 0, right for the forward), while its gradient is pending when the backward replays a segment
ending with the block; pending_grad_bytes, measured against the level after the block's forward (which held
the output), netted the two, and the replay ran above its prediction and budget (fuzz seed 2053, minimised:
R[0:5](K0 K1 K2 K3 K4) measured 1.09x). NOTE [ Dropped outputs at the backward ] in remat.plan.chain."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.plan.chain import chain_of
from remat.plan.planner import plan_from_ops
from remat.plan.types import ops_from_text

D = 24


class _BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x.transpose(1, 2)).transpose(1, 2)  # a non-contiguous view of what BN made


class _Net(nn.Module):
    def __init__(self, n: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.layers = nn.ModuleList([_BN() for _ in range(n)])
        self.mix = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        h = self.mix(h)  # saves a contiguous copy of the last layer's output, which this rebinding frees
        return self.head(self.norm(h))


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
    x, tgt = torch.randn(4, 16, 16), torch.randn(4, 16, 1)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(y, tgt)

    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref = _step(model, x, loss_fn)
    model.load_state_dict(state)
    prof = remat.profile(model, x, loss_fn, repeats=1, progress=False, ops=False)
    model.load_state_dict(state)
    return model, x, loss_fn, state, ref, prof


def _run(case, plan) -> int:
    model, x, loss_fn, state, (ref_g, ref_b), _prof = case
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
    return m.peak_bytes


def test_the_last_output_is_dropped_in_the_head(case) -> None:
    *_, prof = case
    out = 4 * 16 * D * 4
    assert prof.block_profiles[-1].dropped_output_frees == ((len(prof.block_profiles) - 1, out),)
    chain = chain_of(prof)
    assert chain.x_bytes[-1] == 0  # freed in the head's forward, under a segment too
    # ... but its gradient is pending when the backward reaches the last block (268 before the fix).
    assert chain.pending_grad_bytes[chain.n - 1] >= out


def test_smallest_budget_plan_keeps_its_budget(case) -> None:
    *_, prof = case
    with pytest.raises(remat.BudgetInfeasibleError) as e:
        remat.plan(prof, budget="1B")
    plan = remat.plan(prof, budget=e.value.min_peak_bytes)
    peak = _run(case, plan)
    assert peak <= plan.budget_bytes * 1.05, (plan.describe(), peak, plan.budget_bytes)
    assert plan.predicted_peak_bytes * 0.95 <= peak <= plan.predicted_peak_bytes * 1.05, plan.describe()


@pytest.mark.parametrize(
    "text",
    [
        "R[0:5](K0 K1 K2 K3 K4)",  # main: measured 1.09x its prediction
        "K0 K1 R[2:5](K2 K3 K4)",
        "K0 K1 K2 K3 R[4:5](K4)",
        "R[0:5](R[0:2](K0 K1) K2 K3 K4)",
        "R[0:2](K0 K1) K2 K3 K4",
        "K0 K1 K2 K3 K4",
    ],
)
def test_segments_ending_with_the_last_block_are_predicted(case, text: str) -> None:
    *_, prof = case
    plan = plan_from_ops(prof, ops_from_text(text), "by hand")
    peak = _run(case, plan)
    assert plan.predicted_peak_bytes * 0.95 <= peak <= plan.predicted_peak_bytes * 1.05, (text, peak)


class _LinBN(_BN):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The Linear saves a contiguous copy of the previous layer's transposed output, not the output: the
        # last layer's input is freed in the head (a late input), after the segment made it.
        return super().forward(self.lin(x))


@pytest.fixture(scope="module")
def case_lin():
    torch.manual_seed(0)
    model = _Net()
    model.layers = nn.ModuleList([_LinBN() for _ in range(5)])
    x, tgt = torch.randn(4, 16, 16), torch.randn(4, 16, 1)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(y, tgt)

    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref = _step(model, x, loss_fn)
    model.load_state_dict(state)
    prof = remat.profile(model, x, loss_fn, repeats=1, progress=False, ops=False)
    model.load_state_dict(state)
    return model, x, loss_fn, state, ref, prof


@pytest.mark.parametrize("text", ["R[0:5](K0 K1 K2 K3 K4)", "K0 K1 R[2:5](K2 K3 K4)", "R[0:5](R[0:2](K0 K1) K2 K3 K4)"])
def test_late_input_freed_in_the_head_is_pending_at_the_replay(case_lin, text: str) -> None:
    *_, prof = case_lin
    plan = plan_from_ops(prof, ops_from_text(text), "by hand")
    peak = _run(case_lin, plan)
    assert plan.predicted_peak_bytes * 0.95 <= peak <= plan.predicted_peak_bytes * 1.05, (text, peak)
