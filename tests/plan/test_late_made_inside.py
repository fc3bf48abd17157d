"""A tensor made inside a segment that the model's code holds to the head (a skip from before block 0) is
charged by the segment (Chain.late_made_bytes): the plans keep their budget and prediction (fuzz seed 2005)."""

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.errors import BudgetInfeasibleError
from remat.plan.planner import plan_from_ops

D, B, T = 32, 16, 16


class Blk(nn.Module):
    def __init__(self, aux):
        super().__init__()
        self.aux_head = nn.Linear(D, 1) if aux else None

    def forward(self, x):
        x = torch.cat([x[:, :, : D // 2] * 2.0, x[:, :, D // 2 :]], dim=-1)
        if self.aux_head is not None:
            return x, self.aux_head(x).squeeze(-1)
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.blocks = nn.Sequential(Blk(False), Blk(True), Blk(False))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 7)

    def forward(self, x):
        h = self.inp(x)
        saved = h  # held by the model's code to the end of the forward
        aux_total = None
        for i, b in enumerate(self.blocks):
            out = b(h)
            if isinstance(out, tuple):
                h, aux = out
                aux_total = aux.mean()
            else:
                h = out
            if i >= 1:
                h = h + saved
        return self.head(self.norm(h)), aux_total


def _grads(model, x, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(model, x, loss_fn, ref, pl):
    remat.apply(model, pl)
    try:
        got = _grads(model, x, loss_fn)
        assert all(torch.equal(ref[n], got[n]) for n in ref)
        m = remat.measure(model, (x,), loss_fn, steps=1, warmup=1, progress=False)
    finally:
        remat.remove(model)
    if pl.budget_bytes is not None:
        assert m.peak_bytes <= pl.budget_bytes * 1.05, (pl.describe(), m.peak_bytes, pl.budget_bytes)
    assert 0.95 <= m.peak_bytes / pl.predicted_peak_bytes <= 1.05, (
        pl.describe(),
        m.peak_bytes,
        pl.predicted_peak_bytes,
    )


def test_segment_over_a_skip_source_charges_it():
    torch.manual_seed(0)
    model = Net().train()
    x = torch.randn(B, T, 5)
    tgt = torch.randn(B, T, 7)

    def loss_fn(out):
        return F.mse_loss(out[0], tgt) + 0.1 * out[1]

    ref = _grads(model, x, loss_fn)
    prof = remat.profile(model, (x,), loss_fn, blocks=remat.blocks(model), repeats=1, progress=False, ops=False)
    n = len(prof.blocks)
    assert any(li.producer == 0 and li.freed_after >= n for li in prof.late_inputs)
    # the segment over the skip's source, and the smallest-budget plan
    ops = (Recompute(0, 2, (Keep(0), Keep(1))),) + tuple(Keep(i) for i in range(2, n))
    _check(model, x, loss_fn, ref, plan_from_ops(prof, ops, "test"))
    try:
        remat.plan(prof, budget="1B")
    except BudgetInfeasibleError as e:
        _check(model, x, loss_fn, ref, remat.plan(prof, budget=e.min_peak_bytes))
