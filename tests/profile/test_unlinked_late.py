"""Fuzz seed 361 (split blocks), minimised: a tensor made between blocks (an unlinked input) that a later
block takes again and the model's code frees in the head (NOTE [ Unlinked inputs taken again later ] and
NOTE [ Unlinked inputs are allocations, not addresses ] in remat.profile.profiler).

``t = flip(b0(h))`` (``transpose().contiguous().transpose()``, non-contiguous) is made by the model's code between
``b0`` and ``b1``, so it is ``b1``'s unlinked input; ``b2`` takes it too. Neither saves it (a linear layer
saves a contiguous copy of a non-contiguous input), and the model's ``t`` lives until ``forward`` returns: the
plain step frees it in the head, whose measured rise nets that free. A checkpoint over ``b2`` alone holds it
to its backward, so the head runs one ``t`` higher; ``late_inputs`` left every unlinked input out, the
segment charged nothing for it, and the plan measured 1.05x its prediction (the fuzz cell: 1.053x its
budget, 7882624 vs 7489408).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.plan.chain import chain_of
from remat.plan.planner import plan_from_ops

D, T, B = 48, 128, 16


def _flip(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).contiguous().transpose(0, 1)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.b0 = nn.Linear(D, D, bias=False)
        self.b1 = nn.Linear(D, 1)
        self.b2 = nn.Linear(D, D, bias=False)
        self.b3 = nn.SiLU()
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = _flip(self.b0(self.inp(x)))  # made between b0 and b1: b1's unlinked input
        aux = self.b1(t)
        h = self.b3(self.b2(t))  # b2 takes it again; the model's ``t`` lives until forward returns
        return self.head(self.norm(h)), aux.mean()


_BLOCKS = ["b0", "b1", "b2", "b3", "norm"]


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, tgt = torch.randn(B, T, 5, generator=g), torch.randn(B, T, 1, generator=g)

    def loss_fn(out):
        return F.mse_loss(out[0], tgt) + 0.1 * out[1]

    model = _Net()
    prof = remat.profile(model, (x,), loss_fn, blocks=remat.blocks(model, named=_BLOCKS), repeats=1, progress=False)
    return model, x, loss_fn, prof


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
        peak = remat.measure(m, (x,), loss_fn, steps=1, warmup=1, progress=False).peak_bytes
        got = _grads(m, x, loss_fn)
    finally:
        remat.remove(m)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    pred = plan.predicted_peak_bytes
    assert 0.95 * pred <= peak <= 1.05 * pred, (plan.describe(), peak, pred, peak / pred)
    if plan.budget_bytes is not None:
        assert peak <= 1.05 * plan.budget_bytes, (plan.describe(), peak, plan.budget_bytes)


def test_the_profile_finds_the_unlinked_input_taken_again(case) -> None:
    _, _, _, prof = case
    size = B * T * D * 4
    # Charged as b1's unlinked input up to b1 (its "maker" for the chain), taken by b2 from before a segment at 2.
    assert (size, 1, len(_BLOCKS), (1, 2)) in {
        (li.nbytes, li.producer, li.freed_after, tuple(li.users)) for li in prof.late_inputs
    }
    chain = chain_of(prof)
    assert chain.late_held_bytes(2, 3) == chain.late_held_bytes(2, 4) == size
    # A segment through b1 holds it as unlinked_bytes / unsaved_input_bytes already: not charged again.
    assert chain.late_held_bytes(1, 3) == chain.late_made_bytes(1, 3) == chain.late_made_bytes(0, 3) == 0


def test_the_profile_is_the_same_every_run(case) -> None:
    model, x, loss_fn, prof = case
    for _ in range(3):
        again = remat.profile(
            model, (x,), loss_fn, blocks=remat.blocks(model, named=_BLOCKS), repeats=1, progress=False
        )
        assert again.late_inputs == prof.late_inputs


def test_a_segment_over_the_later_taker_is_predicted(case) -> None:
    model, x, loss_fn, prof = case
    ops = (Keep(0), Keep(1), Recompute(2, 3, (Keep(2),)), Keep(3), Keep(4))
    _check(model, x, loss_fn, plan_from_ops(prof, ops, "by hand"))


def test_the_smallest_budget_is_met(case) -> None:
    model, x, loss_fn, prof = case
    with pytest.raises(remat.BudgetInfeasibleError) as info:
        remat.plan(prof, budget="1B")
    _check(model, x, loss_fn, remat.plan(prof, budget=info.value.min_peak_bytes))


def _synthetic():
    """Three blocks; ``A`` (before block 0, taken by it, freed after block 1 starts) and ``U``, made between
    blocks 1 and 2 at ``A``'s freed address (block 2's unlinked input); ``V`` made between blocks 0 and 1
    (block 1's unlinked input), taken again by block 2, freed in the head."""
    from types import SimpleNamespace

    from remat.core.trace import MemoryTrace

    a = u = 0x1000
    v = 0x2000
    events = [(5, a, 100), (25, v, 300), (45, a, -100), (47, u, 200), (70, v, -300), (150, u, -200)]
    level, levels = 0, []
    for _, _, d in events:
        level += d
        levels.append(level)
    marks = (("F0", 10), ("f0", 20), ("F1", 30), ("f1", 40), ("F2", 50), ("f2", 60), ("B2", 100))
    trace = MemoryTrace(
        t_ns=tuple(t for t, _, _ in events),
        level_bytes=tuple(levels),
        marks=marks,
        peak_bytes=max(levels),
        duration_ns=200,
        device="cpu",
        ptrs=tuple(p for _, p, _ in events),
        deltas=tuple(d for _, _, d in events),
    )
    tracked = SimpleNamespace(
        inputs=[{a: 100}, {v: 300}, {u: 200, v: 300}],
        _unlinked_storages=[{}, {v: 300}, {u: 200}],
    )
    return trace, tracked


def test_an_unlinked_input_at_a_freed_address_hides_nothing() -> None:
    # NOTE [ Unlinked inputs are allocations, not addresses ]: U at A's old address is another tensor.
    from remat.profile.profiler import _late_inputs

    trace, tracked = _synthetic()
    late = {(li.nbytes, li.producer, li.freed_after, tuple(li.users)) for li in _late_inputs(trace, tracked, 3)}
    assert (100, -1, 1, (0,)) in late
    assert not any(nbytes == 200 for nbytes, *_ in late)  # U is block 2's unlinked input, freed in the backward


def test_an_unlinked_input_taken_again_is_a_late_input_from_its_block() -> None:
    # NOTE [ Unlinked inputs taken again later ]: V is block 1's unlinked input, block 2 takes it too.
    from remat.profile.profiler import _late_inputs

    trace, tracked = _synthetic()
    late = {(li.nbytes, li.producer, li.freed_after, tuple(li.users)) for li in _late_inputs(trace, tracked, 3)}
    assert (300, 1, 3, (1, 2)) in late
