"""A segment whose last block ends with an in-place op on a view replays above CopySlices' buffers
(NOTE [ Replay level ] in remat.profile.profiler; fuzz seed 124)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.errors import BudgetInfeasibleError

D, T, B = 24, 32, 2


class _Blk(nn.Module):
    def __init__(self, tail: bool) -> None:
        super().__init__()
        self.tail = tail
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        if tail:
            self.conv, self.act = nn.Conv1d(D, D, 3, padding=1), nn.SiLU(inplace=True)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + self.o(torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), dim=-1) @ v)
        if self.tail:
            x = self.act(self.conv(x.transpose(1, 2)).transpose(1, 2))  # in place on a view: CopySlices
        return x


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.blocks = nn.ModuleList([_Blk(True), _Blk(False)])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 7)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def _grads(model, x, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_replay_above_in_place_view_backward_buffers():
    torch.manual_seed(0)
    model = _Net()
    x, tgt = torch.randn(B, T, 16), torch.randn(B, T, 7)

    def loss_fn(out):
        return F.mse_loss(out, tgt)

    ref = _grads(model, x, loss_fn)
    prof = remat.profile(model, (x,), loss_fn, repeats=1, progress=False)
    try:
        pl = remat.plan(prof, budget="1B")
    except BudgetInfeasibleError as e:
        pl = remat.plan(prof, budget=e.min_peak_bytes)
    remat.apply(model, pl)
    try:
        got = _grads(model, x, loss_fn)
        m = remat.measure(model, (x,), loss_fn, steps=1, warmup=1, progress=False)
    finally:
        remat.remove(model)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert m.peak_bytes <= pl.budget_bytes * 1.05, (pl.describe(), m.peak_bytes, pl.budget_bytes)
    assert 0.95 <= m.peak_bytes / pl.predicted_peak_bytes <= 1.05, (
        pl.describe(),
        m.peak_bytes,
        pl.predicted_peak_bytes,
    )
