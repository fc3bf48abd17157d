"""A caller's dispatch mode around the forward only is a RematError in the replay; around the whole step, or
one that only observes, replays exactly (NOTE [ Dispatch modes around the forward ] in remat.core.runtime)."""

import copy

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import remat
from remat.core.ops import Keep, Recompute, RecomputeOps
from remat.plan.types import Plan

D = 16


class _FakeQuant(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return torch.round(out * 8) / 8 if func is torch.ops.aten.addmm.default else out


class _FakeQuantLinear(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear:
            out = out + (torch.round(out * 8) / 8 - out).detach()  # straight-through
        return out


class _Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Blk() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


_OPS = {
    "full": lambda n: tuple(Recompute(i, i + 1, (Keep(i),)) for i in range(n)),
    "segment": lambda n: (Recompute(0, n, tuple(Keep(i) for i in range(n))),),
    "policy": lambda n: tuple(RecomputeOps(i, ()) for i in range(n)),
}


def _planned(ops):
    torch.manual_seed(0)
    plain = _Net()
    planned = copy.deepcopy(plain)
    blocks = remat.blocks(planned, include="layers.*")
    remat.apply(planned, Plan("custom", blocks, _OPS[ops](len(blocks))))
    return plain, planned, torch.randn(4, D)


@pytest.mark.parametrize("ops", sorted(_OPS))
def test_a_dispatch_mode_around_the_forward_only_is_a_remat_error(ops):
    plain, planned, x = _planned(ops)
    with _FakeQuant():
        out = planned(x)
    with pytest.raises(remat.RematError, match="TorchDispatchMode"):
        out.pow(2).sum().backward()


@pytest.mark.parametrize("ops", sorted(_OPS))
def test_a_function_mode_around_the_forward_only_is_entered_again_for_the_replay(ops):
    plain, planned, x = _planned(ops)
    grads = []
    for model in (plain, planned):
        with _FakeQuantLinear():
            out = model(x)
        out.pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("mode", [_FakeQuant, _FakeQuantLinear, lambda: FlopCounterMode(display=False)])
@pytest.mark.parametrize("ops", sorted(_OPS))
def test_a_dispatch_mode_around_the_step_or_an_observer_replays_exactly(ops, mode):
    plain, planned, x = _planned(ops)
    grads = []
    for model in (plain, planned):
        with mode():
            out = model(x)
            out.pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    observed = []
    for model in (plain, planned):  # FLOP counting around the forward only changes no value
        model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False):
            out = model(x)
        out.pow(2).sum().backward()
        observed.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*observed))
