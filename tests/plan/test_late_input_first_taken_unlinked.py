"""A tensor the model's code makes between two blocks, taken by the first one (unlinked) and by a later one, and
freed by the plain step in the head (a dead branch saved it): a checkpoint over the later block holds it from the
head to its backward (NOTE [ Late inputs first taken unlinked ] in remat.profile.profiler, NOTE [ Late inputs
freed in the head ] in remat.plan.solver). Before the fix: R[4:5](K4) measured 1.05-1.1x its prediction, the
min plan above its budget (fuzz_ext seed 138 split/min, 1.053x)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.errors import BudgetInfeasibleError
from remat.plan.planner import plan_from_ops

B, T, D = 8, 32, 16


class _Layer(nn.Module):
    """Parameter-free: a masked_fill body (saves only its boolean masks)."""

    def __init__(self, reps: int, aux: bool = False) -> None:
        super().__init__()
        self.mods = nn.ModuleDict()
        self.reps = reps
        self.aux_head = nn.Linear(D, 1) if aux else None

    def forward(self, x: torch.Tensor):
        for _ in range(self.reps):
            x = x.masked_fill(x.abs() < 0.05, 0.0) * 1.5
        if self.aux_head is not None:
            return x, self.aux_head(x).squeeze(-1)  # aux is never used: the Linear's saved x dies with it
        return x


class _Net(nn.Module):
    def __init__(self, reps: tuple[int, ...], out: int) -> None:
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.n = len(reps)
        for i, r in enumerate(reps):
            setattr(self, f"layer{i}", _Layer(r, aux=i == 2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        aux_prev = None
        for i in range(self.n):
            out = getattr(self, f"layer{i}")(h)
            if isinstance(out, tuple):
                h, aux_prev = out  # held until the model returns
            else:
                h = out
        return self.head(self.norm(h))  # aux_prev dies as the model returns


def _case(reps, out):
    torch.manual_seed(0)
    model = _Net(reps, out)
    x = torch.randn(B, T, 5, requires_grad=True)
    target = torch.randn(B, T, out)
    return model, x, lambda y: F.mse_loss(y, target)


def _step(model, x, loss_fn):
    for p in model.parameters():
        p.grad = None
    x.grad = None
    torch.manual_seed(1)
    loss_fn(model(x)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, x.grad.clone()


def _check(model, x, loss_fn, plan, ref):
    remat.apply(model, plan)
    try:
        grads, xg = _step(model, x, loss_fn)
        assert grads.keys() == ref[0].keys()
        assert all(torch.equal(grads[k], ref[0][k]) for k in grads)
        assert torch.equal(xg, ref[1])
        peak = remat.measure(model, x, loss_fn, steps=1, warmup=1, progress=False, grads="held").peak_bytes
    finally:
        remat.remove(model)
    pred = plan.predicted_peak_bytes
    assert 0.95 * pred <= peak <= 1.05 * pred, (plan.describe(), peak, pred)
    if plan.budget_bytes is not None:
        assert peak <= 1.05 * plan.budget_bytes, (plan.describe(), peak, plan.budget_bytes)
    return peak


# Before the fix (measured/predicted): the hand plan 1.083 and 1.056, the min plan 1.088 and 1.065 (above its budget).
@pytest.mark.parametrize(("reps", "out"), [((2, 2, 2, 2, 2, 2), 32), ((2, 2, 2, 2, 1, 1), 64)])
def test_a_checkpoint_after_the_unlinked_taker_holds_the_tensor_from_the_head(reps, out) -> None:
    model, x, loss_fn = _case(reps, out)
    ref = _step(model, x, loss_fn)
    blocks = remat.blocks(model, split=True)
    names = [b.fqns[0] for b in blocks]
    assert names[3:5] == ["layer2.aux_head", "layer3"], names
    prof = remat.profile(model, x, loss_fn, blocks=blocks, repeats=1, progress=False, ops=False, grads="held")
    n = len(blocks)
    ops = (*(Keep(i) for i in range(4)), Recompute(4, 5, (Keep(4),)), *(Keep(i) for i in range(5, n)))
    hand = plan_from_ops(prof, ops, "hand")
    hand = plan_from_ops(prof, ops, "hand", budget_bytes=hand.predicted_peak_bytes)
    _check(model, x, loss_fn, hand, ref)
    try:
        remat.plan(prof, budget="1B")
        raise AssertionError("a 1-byte budget was accepted")
    except BudgetInfeasibleError as e:
        best = remat.plan(prof, budget=e.min_peak_bytes)
    _check(model, x, loss_fn, best, ref)
    # layer2's body output: made between blocks for aux_head (unlinked), taken by layer3 too, freed in the head.
    m = B * T * D * 4
    assert any(li.nbytes == m and li.users == (3, 4) and li.freed_after == n for li in prof.late_inputs), (
        prof.late_inputs
    )
