"""Fuzz seed 2264 (split blocks, ``sqrt()``), minimised: tensors a segment holds that the plain step frees in the
gap after a later block that does not take them (NOTE [ Held inputs freed in a later gap ] in remat.plan.chain).

Each layer runs ``dropout`` then ``conv`` (the split blocks), then ``softmax(x) * D`` in its own code; the model's
``h = layer(h)`` drops the layer's input when the layer returns. So the chain's input (block 0's) is freed in the
gap after block 1, and the first layer's output (block 2's input, made between blocks 1 and 2) in the gap after
block 3. Each gap nets the free against the softmax and the product, while a segment over blocks 0..2 holds both
tensors: ``R[0:3](K0 K1 K2) K3 ..`` (``sqrt()``'s plan) measured two tensors above its prediction (1.070x in the
fuzz cell, 1.24x here).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.plan.planner import plan_from_ops
from remat.plan.types import ops_from_text

D, T, B = 16, 128, 16


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.3)
        self.conv = nn.Conv1d(D, D, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x)
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return torch.softmax(x, dim=-1) * D


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, D)
        self.layers = nn.Sequential(*(_Layer() for _ in range(3)))
        self.head = nn.Linear(D, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, tgt = torch.randint(0, 11, (B, T), generator=g), torch.randn(B, T, 7, generator=g)

    def loss_fn(out):
        return F.mse_loss(out, tgt)

    model = _Net()
    blocks = remat.blocks(model, split=True)
    assert [b.fqns[0] for b in blocks] == [f"layers.{i}.{m}" for i in range(3) for m in ("dropout", "conv")]
    prof = remat.profile(model, (x,), loss_fn, blocks=blocks, repeats=1, progress=False, ops=False)
    return model, x, loss_fn, prof


def _grads(model, x, loss_fn):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss_fn(model(x)).backward()
    return [p.grad.clone() for p in model.parameters()]


def _run(case, text):
    model, x, loss_fn, prof = case
    plan = plan_from_ops(prof, ops_from_text(text), "text")
    ref = _grads(copy.deepcopy(model), x, loss_fn)
    m = copy.deepcopy(model)
    remat.apply(m, plan)
    try:
        got = _grads(m, x, loss_fn)
        torch.manual_seed(1)
        peak = remat.measure(m, (x,), loss_fn, steps=1, warmup=1, progress=False).peak_bytes
    finally:
        remat.remove(m)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    return plan, peak


def test_the_profile_finds_the_later_free(case) -> None:
    _, _, _, prof = case
    size = B * T * D * 4
    late = {(li.nbytes, li.producer, li.freed_after, tuple(li.users)) for li in prof.late_inputs}
    # The chain's input (taken by block 0, freed after block 1), the layers' outputs (made between blocks for
    # blocks 2 and 4, freed after blocks 3 and 5).
    assert {(size, -1, 1, (0,)), (size, 2, 3, (2,))} <= late


@pytest.mark.parametrize(
    "text",
    [
        "R[0:3](K0 K1 K2) K3 K4 K5",  # sqrt()'s plan: both frees (1.150x before)
        "K0 R[1:3](K1 K2) K3 K4 K5",  # block 2's input only, freed after the segment (1.072x before)
    ],
)
def test_a_segment_holding_them_is_predicted(case, text) -> None:
    plan, peak = _run(case, text)
    pred = plan.predicted_peak_bytes
    assert 0.95 * pred <= peak <= 1.05 * pred, (plan.describe(), peak, pred, peak / pred)


def test_two_segments_over_them_are_not_predicted_low(case) -> None:
    # 1.067x before; on the safe side after (0.94x): the second segment's replay, which the chain charges with
    # the code's allocations between its blocks, which a replay does not make.
    plan, peak = _run(case, "R[0:3](K0 K1 K2) R[3:6](K3 K4 K5)")
    pred = plan.predicted_peak_bytes
    assert 0.9 * pred <= peak <= 1.05 * pred, (plan.describe(), peak, pred, peak / pred)
