"""A sub-module's input that its block does not save is held by the sub-module's checkpoint, even where the
allocator hands its address to a tensor the block saves later (NOTE [ Inputs a block saves are storages,
not addresses ] in ``remat.core.probe``). Drop into tests/plan/ (uses tests/conftest.py's exact_peak)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.core.ops import Keep, RecomputeSub
from remat.plan.planner import plan_from_ops

from ..conftest import exact_peak

B, T, D = 16, 16, 32
TOLERANCE = 0.01


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, dropout=0.1, batch_first=True)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(x, (0, 1))[..., :D]  # a storage of a size nothing else has; attn saves transposed copies only
        o, _ = self.attn(h, h, h, need_weights=False)
        del h  # freed: its address goes to the next allocation of that size ...
        y = F.pad(o, (0, 1))  # ... y, which sin saves
        return self.fc(self.ln(x + y.sin()[..., :D]))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(3))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _case():
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(B, T, D)
    tgt = torch.randn(B, T, 1)
    return model, (x,), lambda out: F.mse_loss(out, tgt)


def test_freed_input_whose_address_is_saved_later_is_held() -> None:
    model, inputs, loss_fn = _case()
    prof = remat.profile(model, inputs, loss_fn, repeats=1, progress=False)
    input_bytes = B * T * (D + 1) * 4
    for bp in prof.block_profiles:
        (sub,) = [s for s in bp.subs if s.fqn.endswith("attn")]
        assert [nbytes for _, nbytes in sub.held_inputs] == [input_bytes], sub


@pytest.mark.parametrize("subs", [(1,), (0, 1), (0, 1, 2)])
def test_sub_plans_predicted_exactly_and_exact_grads(subs: tuple[int, ...]) -> None:
    model, inputs, loss_fn = _case()
    prof = remat.profile(model, inputs, loss_fn, repeats=1, progress=False)
    ops = tuple(RecomputeSub(b.index, b.attention_fqns) if b.index in subs else Keep(b.index) for b in prof.blocks)
    assert all(prof.blocks[i].attention_fqns for i in subs)
    plan = plan_from_ops(prof, ops, "test")
    assert plan.predicted_peak_bytes is not None
    measured = exact_peak(copy.deepcopy(model), plan, inputs, loss_fn)
    assert abs(measured / plan.predicted_peak_bytes - 1) <= TOLERANCE, (measured, plan.predicted_peak_bytes)

    # torch.equal oracle: same seed, dropout included
    ref = copy.deepcopy(model)
    torch.manual_seed(7)
    loss_fn(ref(*inputs)).backward()
    got = copy.deepcopy(model)
    remat.apply(got, plan)
    torch.manual_seed(7)
    loss_fn(got(*inputs)).backward()
    remat.remove(got)
    for (name, a), (_, b) in zip(ref.named_parameters(), got.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
