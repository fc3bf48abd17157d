"""NOTE [ Replays of op-level policies ]: a storage is alive through the last op that ran before it died."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, RecomputeOps
from remat.plan.planner import plan_from_ops
from remat.plan.policies import _alive, _replay_rise, policy_menu
from remat.profile.ops import BlockOps, OpRecord, profile_ops

D = 32


def test_a_temporary_is_alive_through_the_op_that_made_it_die_not_one_more() -> None:
    ops = (
        OpRecord(0, "mul#0", "mul", 0.1, 100, 0, (), (0,), freed=2),  # died after op 1 ran, before op 2
        OpRecord(1, "sum#0", "sum", 0.1, 10, 10, (0,), (1,)),
        OpRecord(2, "addmm#0", "addmm", 1.0, 40, 40, (1,), (2,)),
        OpRecord(3, "tanh#0", "tanh", 0.1, 40, 40, (2,), (3,)),
    )
    b = BlockOps(0, "b", ops, 90, 0, 4)
    live = _alive(b, range(4))
    assert live == [100, 110, 50, 90]
    assert _replay_rise(b, live, {2}, 110) == 110  # the forward's peak at op 1, before the cached addmm
    assert _replay_rise(b, live, set(), 110) == 110
    assert _replay_rise(b, live, {2}, 160) == 110 + 50  # a workspace above the storages' peak


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * 2  # the addmm's output dies when the mul returns
        return torch.tanh(torch.sin(h))


def test_the_profile_records_a_temporary_as_dying_after_the_op_that_read_it_last() -> None:
    model = nn.Sequential(_Chain(), nn.Linear(8, 1))
    (b,) = profile_ops(model, torch.randn(4, 8), lambda y: y.sum(), [remat.blocks(model)[0]], rounds=1)
    addmm = next(op for op in b.ops if op.name == "addmm")
    mul = next(op for op in b.ops if op.name == "mul")
    assert addmm.freed == mul.index + 1
    live = _alive(b, [addmm.index])
    assert live[mul.index] == addmm.out_bytes and live[mul.index + 1] == 0


class _NoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        with torch.no_grad():
            scale = h.abs().amax(-1, keepdim=True) + 1
            noise = torch.randn_like(h) * 0.01
        return x + torch.tanh(h / scale + noise)


def _make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_NoGrad(), _NoGrad(), _NoGrad(), nn.Linear(D, 1))


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_every_menu_policy_measures_its_prediction_and_gives_the_plain_gradients() -> None:
    x = torch.randn(8, 32, D)
    loss = lambda y: y.square().mean()  # noqa: E731
    prof = remat.profile(_make(), x, loss, repeats=3)
    plain = _grads(_make(), x)
    menu = policy_menu(prof.block_ops[1])
    assert menu
    for p in menu:
        plan = plan_from_ops(prof, (Keep(0), RecomputeOps(1, p.save, p.freed), Keep(2)), "by hand")
        model = _make()
        remat.apply(model, plan)
        assert all(torch.equal(a, b) for a, b in zip(plain, _grads(model, x))), p.save
        peak = remat.measure(model, x, loss, steps=2).peak_bytes
        remat.remove(model)
        assert peak == pytest.approx(plan.predicted_peak_bytes, rel=0.01), p.save  # 0.88x before
