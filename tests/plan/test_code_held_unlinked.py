"""Fuzz seed 836 (split blocks, sqrt()), hand-written: a block's output that the model's code holds past its
last taker, which takes a view of it made between blocks (an unlinked input) and saves a contiguous copy of
that view, not the view (NOTE [ Code-held frees the plain step nets ] in remat.profile.profiler).

``blocks.0`` returns ``bn0(x.transpose(1, 2)).transpose(1, 2)`` and ``aux_head`` of it. The plain step frees
``bn0``'s output where the model rebinds ``h`` (after ``blocks.1`` returns: in the head), so the head's measured
peak nets that free; the simulation took it off once more after the last block, and ``R[0:2](K0 K1) K2 K3``
(sqrt()'s plan) measured 1.08x its prediction. With a block after the one whose return drops it, the free
lands in a kept block's gap (netted by its ``gap_bytes``) or in a segment's (netted as far as its
``segment_bytes`` counts that gap: Chain.gap_netted_bytes).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.plan.chain import chain_of
from remat.plan.planner import plan_from_ops
from remat.plan.types import ops_from_text

D, T, B, OUT = 64, 16, 4, 128


class _First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn0, self.aux_head = nn.BatchNorm1d(D), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.bn0(x.transpose(1, 2)).transpose(1, 2)  # a view of bn0's output
        return x, self.aux_head(x).squeeze(-1)  # the Linear saves a contiguous copy of the view


class _Second(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.aux_head = nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, aux_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.softmax(x + aux_in.unsqueeze(-1), dim=-1) * D
        x = self.linear(x)
        return x, self.aux_head(x).squeeze(-1)


class _Third(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Net(nn.Module):
    def __init__(self, third: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.blocks = nn.ModuleList([_First(), _Second()] + ([_Third()] if third else []))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(x)
        h, aux = self.blocks[0](h)
        h, aux2 = self.blocks[1](h, aux)  # bn0's output (the old h) dies here, in the plain step too
        if len(self.blocks) > 2:
            h = self.blocks[2](h)
        return self.head(self.norm(h)), aux.mean() + aux2.mean()


_BLOCKS = ["blocks.0.bn0", "blocks.0.aux_head", "blocks.1.linear", "blocks.1.aux_head"]


def _case(third: bool):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, tgt = torch.randn(B, T, 5, generator=g), torch.randn(B, T, OUT, generator=g)

    def loss_fn(out):
        y, aux = out
        return F.mse_loss(y, tgt) + 0.1 * aux

    model = _Net(third)
    names = _BLOCKS + (["blocks.2.up", "blocks.2.down"] if third else [])
    prof = remat.profile(
        model, (x,), loss_fn, blocks=remat.blocks(model, named=names), repeats=1, progress=False, grads="held"
    )
    return model, x, loss_fn, prof


@pytest.fixture(scope="module")
def case():
    return _case(third=False)


@pytest.fixture(scope="module")
def case_third():
    return _case(third=True)


def _grads(model, x, loss_fn):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss_fn(model(x)).backward()
    return [p.grad.clone() for p in model.parameters()]


def _check(model, x, loss_fn, plan) -> None:
    ref = _grads(copy.deepcopy(model), x, loss_fn)
    m = copy.deepcopy(model)
    remat.apply(m, plan)
    try:
        got = _grads(m, x, loss_fn)
        peak = remat.measure(m, (x,), loss_fn, steps=1, warmup=1, progress=False, grads="held").peak_bytes
    finally:
        remat.remove(m)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    pred = plan.predicted_peak_bytes
    assert 0.95 * pred <= peak <= 1.05 * pred, (plan.describe(), peak, pred, peak / pred)


def test_the_profile_marks_the_free_the_plain_step_makes(case) -> None:
    _, _, _, prof = case
    size = B * T * D * 4
    held = {(li.nbytes, li.producer, li.freed_after, tuple(li.users), li.netted) for li in prof.code_held_inputs}
    assert held == {(size, 0, 3, (1,), True)}  # bn0's output: aux_head takes a view, the head frees it
    chain = chain_of(prof)
    # Freed after block 3 (the last: the head's measured peak nets the plain step's free of it).
    assert chain.code_held_frees(0, 2) == ((3, size, 3),)


@pytest.mark.parametrize(
    "text",
    [
        "R[0:2](K0 K1) K2 K3",  # sqrt()'s plan
        "R[0:2](K0 K1) K2 R[3:4](K3)",
        "R[0:2](R[0:1](K0) K1) K2 K3",
    ],
)
def test_a_segment_over_the_view_taker_is_predicted(case, text) -> None:
    model, x, loss_fn, prof = case
    _check(model, x, loss_fn, plan_from_ops(prof, ops_from_text(text), "by hand"))


def test_sqrt_is_predicted(case) -> None:
    model, x, loss_fn, prof = case
    _check(model, x, loss_fn, remat.plan(prof, strategy="sqrt"))


@pytest.mark.parametrize(
    "text",
    [
        "R[0:2](K0 K1) K2 K3 K4 K5",  # freed in the gap after the kept block 3
        "R[0:2](K0 K1) R[2:4](K2 K3) K4 K5",  # in the last gap of a segment (released_bytes nets it)
        "R[0:2](K0 K1) K2 R[3:5](K3 K4) K5",  # inside a segment (its rises-only gap does not): taken off
    ],
)
def test_the_free_after_a_later_block_is_predicted(case_third, text) -> None:
    model, x, loss_fn, prof = case_third
    _check(model, x, loss_fn, plan_from_ops(prof, ops_from_text(text), "by hand"))
