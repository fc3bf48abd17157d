"""A segment's replay runs above the gradients pending at its last block's backward, measured against the level
at that block's end in the plain step: what the chain books as freed earlier, or the segment never holds, must be
added back (NOTE [ Pending gradients above the chain's level ], NOTE [ Late inputs made inside a segment ] in
remat/plan/chain.py). Fuzz seeds 2058 and 2175 (whole blocks, min budget) measured 1.093x / 1.076x their budget."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.core.ops import Keep as K
from remat.core.ops import Recompute as R
from remat.plan.chain import chain_of
from remat.plan.planner import plan_from_ops

D = 16


class Attn(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.qkv, self.o, self.drop, self.scale = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.Dropout(0.1), scale

    def forward(self, x):
        x = x * self.scale if self.scale else x
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        p = self.drop(torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), dim=-1))
        return x + self.o(p @ v)


class Lin(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.l, self.scale = nn.Linear(D, D), scale

    def forward(self, x):
        return self.l(x * self.scale if self.scale else x)


class Soft(nn.Module):
    """No parameters: folded into the head; rebinding ``h`` drops the last block's output there."""

    def __init__(self, scale, d=D):
        super().__init__()
        self.scale, self.d = scale, d

    def forward(self, x):
        return torch.softmax(x * self.scale if self.scale else x, dim=-1) * self.d


class Blk(nn.Module):
    """One block class for the stack (remat.blocks finds repeated classes)."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x)


class Net(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.blocks = nn.Sequential(Blk(Attn(scale)), Blk(Lin(scale)), Blk(Soft(scale)))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 7)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


class BN(nn.Module):
    def __init__(self, d, soft):
        super().__init__()
        self.bn, self.soft, self.d = nn.BatchNorm1d(d), soft, d

    def forward(self, x):
        x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        return torch.softmax(x, dim=-1) * self.d if self.soft else x


class SkipNet(nn.Module):
    """The last block ends with ``softmax(x) * d``: its backward allocates before the replay starts."""

    def __init__(self, d=24):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.layer0, self.layer1, self.layer2 = Soft(None, d), BN(d, False), BN(d, True)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 7)

    def forward(self, x):
        h = self.inp(x)
        saved = h
        h = self.layer2(self.layer1(self.layer0(h)))
        return self.head(self.norm(h + saved))


def _case(kind):
    torch.manual_seed(0)
    model = SkipNet() if kind == "unpack" else Net(1.5 if kind == "late" else None)
    B, T = (8, 128) if kind == "unpack" else (16, 16)
    g = torch.Generator().manual_seed(0)
    x, tgt = torch.randn(B, T, 5, generator=g), torch.randn(B, T, 7, generator=g)
    return model, (x,), lambda out: F.mse_loss(out, tgt)


def _blocks(model, kind):
    return remat.blocks(model, named=["layer1", "layer2"] if kind == "unpack" else ["blocks.0", "blocks.1"])


def _grads(model, inputs, loss_fn):
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    loss_fn(model(*inputs)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


PLANS = {
    "dropped": [(R(0, 2, (K(0), K(1))),), (K(0), R(1, 2, (K(1),)))],
    "late": [(R(0, 2, (K(0), K(1))),)],
    "unpack": [(K(0), R(1, 2, (K(1),))), (R(0, 2, (K(0), K(1))),)],
}


@pytest.mark.parametrize("kind,i", [(k, i) for k, v in PLANS.items() for i in range(len(v))])
def test_replay_pending_is_charged(kind, i):
    model, inputs, loss_fn = _case(kind)
    ref = _grads(model, inputs, loss_fn)
    prof = remat.profile(model, inputs, loss_fn, blocks=_blocks(model, kind), repeats=1, progress=False, grads="none")
    assert chain_of(prof).n == 2
    pl = plan_from_ops(prof, PLANS[kind][i], "test")
    remat.apply(model, pl)
    try:
        got = _grads(model, inputs, loss_fn)
        m = remat.measure(model, inputs, loss_fn, steps=1, warmup=1, progress=False, grads="none")
    finally:
        remat.remove(model)
    assert ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref)
    # Never above the prediction (before the fix: dropped 1.014x, late 1.013x, unpack 1.140x; the fuzz cells
    # these come from, seeds 2058 and 2175, 1.093x and 1.076x their budget). The late case is predicted on the
    # safe side after the fix (0.93x: the replayed K0 charges the tensor the model's code held, which nothing
    # holds in a replay), the others exactly.
    low = 0.9 if kind == "late" else 0.995
    assert low * pl.predicted_peak_bytes <= m.peak_bytes <= 1.005 * pl.predicted_peak_bytes, (
        pl.describe(),
        m.peak_bytes,
        pl.predicted_peak_bytes,
    )


@pytest.mark.parametrize("kind", ["dropped", "late", "unpack"])
def test_min_budget_plan_is_within_budget(kind):
    model, inputs, loss_fn = _case(kind)
    prof = remat.profile(model, inputs, loss_fn, blocks=_blocks(model, kind), repeats=1, progress=False, grads="none")
    try:
        remat.plan(prof, budget="1B")
    except remat.BudgetInfeasibleError as e:
        pl = remat.plan(prof, budget=e.min_peak_bytes)
    remat.apply(model, pl)
    try:
        m = remat.measure(model, inputs, loss_fn, steps=1, warmup=1, progress=False, grads="none")
    finally:
        remat.remove(model)
    assert m.peak_bytes <= 1.005 * pl.budget_bytes, (pl.describe(), m.peak_bytes, pl.budget_bytes)
