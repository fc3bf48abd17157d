"""Attributes a block's forward creates (``self.step = getattr(self, "step", 0) + 1``) or tensor attributes it
rebinds (``self.ema = 0.9 * self.ema + ...``): a replay computes with their values at the call, so gradients
stay bitwise those of the plain model (NOTE [ Attributes a forward sets ] in ``remat.core.runtime``). Before,
a replay read the value the forward had left behind, silently."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import RecomputeOps
from remat.plan.types import Plan


class _LazyCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step = getattr(self, "step", 0) + 1  # created by the first call
        return x + self.fc2(torch.tanh(self.fc1(x)) / self.step)


class _LazyAverage(_LazyCounter):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if not hasattr(self, "ema"):  # a plain tensor attribute made by the first call
            self.ema = h.detach().mean(0)
        else:
            self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        return x + self.fc2(torch.tanh(h - self.ema))


class _History(_LazyCounter):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A list of tensors, rebound by every call; its length scales the output (a Python number: what the
        # next layer of a segment saves depends on it).
        self.hist = getattr(self, "hist", [])[-2:] + [x.detach().mean()]
        return x + self.fc2(torch.tanh(self.fc1(x))) * len(self.hist)


class _Average(_LazyCounter):
    def __init__(self) -> None:
        super().__init__()
        self.ema = torch.zeros(32)  # a plain tensor attribute, rebound by every forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        return x + self.fc2(torch.tanh(h - self.ema))


def _model(layer: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[layer() for _ in range(4)], nn.Linear(16, 1))


def _full(model: nn.Module) -> remat.Strategy:
    return remat.full()


def _policy(model: nn.Module) -> Plan:
    # An op-level policy on every layer: torch's selective checkpoint recomputes the block's forward.
    blocks = tuple(remat.blocks(model, types=(_LazyCounter,)))
    ops = tuple(RecomputeOps(i, save=("addmm#0",), recompute=("tanh#0",)) for i in range(len(blocks)))
    return Plan(strategy="by hand", blocks=blocks, ops=ops)


def _steps(model: nn.Module, n: int = 3) -> list[list[torch.Tensor]]:
    torch.manual_seed(1)
    x = torch.randn(8, 16)
    out = []
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        out.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    return out


def _segments(model: nn.Module) -> remat.Strategy:
    return remat.segments(2)


@pytest.mark.parametrize("target", [_full, _segments, _policy], ids=["full", "segments", "policy"])
@pytest.mark.parametrize("layer", [_LazyCounter, _LazyAverage, _Average, _History])
def test_replay_sees_the_attributes_at_the_call(
    layer: type[nn.Module], target: Callable[[nn.Module], remat.Strategy | Plan]
) -> None:
    plain = _steps(_model(layer))
    model = _model(layer)
    remat.apply(model, target(model))
    planned = _steps(model)
    assert len(plain[0]) == len(planned[0]) == 18
    for step_plain, step_planned in zip(plain, planned):
        assert all(torch.equal(a, b) for a, b in zip(step_plain, step_planned))
    # The forward's values are left bound, not the replay's.
    reference = _model(layer)
    _steps(reference)
    for mine, theirs in zip(model[:4], reference[:4]):
        for name in ("step", "ema", "hist"):
            if hasattr(theirs, name):
                a, b = getattr(mine, name), getattr(theirs, name)
                if isinstance(b, list):
                    assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))
                else:
                    assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b


def test_attribute_created_before_a_refusal_is_removed() -> None:
    # A learning call that refuses (a stateful buffer) puts back what it created, as what it changed.
    class _Stateful(_LazyCounter):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen += 1
            return super().forward(x)

    model = _model(_Stateful)
    remat.apply(model, remat.full())
    with pytest.raises(remat.RematError, match="updates buffer"):
        model(torch.randn(8, 16))
    assert not hasattr(model[0], "step")


class _Scaled(_LazyCounter):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones(())  # a plain tensor attribute the model's code rebinds after each call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.fc2(torch.tanh(self.fc1(x)))) * self.scale


class _Rebinding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Scaled() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            layer.scale = x.detach().abs().mean()  # the value the block's next call reads
        return x.sum(dim=1)


@pytest.mark.parametrize("plan", ["full", "segments(2)"])
def test_tensor_attribute_rebound_by_the_model(plan: str) -> None:
    plain = _steps(_Rebinding())
    model = _Rebinding()
    remat.apply(model, remat.full() if plan == "full" else remat.segments(2))
    planned = _steps(model)
    for step_plain, step_planned in zip(plain, planned):
        assert len(step_plain) == len(step_planned) == 16
        assert all(torch.equal(a, b) for a, b in zip(step_plain, step_planned))


class _AuxLayer(nn.Module):
    def __init__(self, losses: list[torch.Tensor]) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        object.__setattr__(self, "losses", losses)  # the model's list, shared by every layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        self.losses.append(h.pow(2).mean())  # an aux loss, with its graph
        return (x + self.fc2(h)) * (1.0 + 0.1 * len(self.losses))


class _AuxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.losses: list[torch.Tensor] = []
        self.layers = nn.ModuleList(_AuxLayer(self.losses) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.losses.clear()
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean() + torch.stack(self.losses).sum()


def test_shared_aux_list_is_as_at_the_call_and_not_held() -> None:
    # The list a layer appends to is set back as it was at the call for its replay (its length is read),
    # and as a fresh copy: the replay's aux loss (with the replay's graph) stays in no record.
    x = torch.randn(256, 32)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out

    prof = remat.profile(_AuxNet(), x, loss, repeats=1, ops=False)
    with pytest.raises(remat.BudgetInfeasibleError) as info:
        remat.plan(prof, budget="1B")
    plan = remat.plan(prof, budget=info.value.min_peak_bytes)
    check = remat.check_gradients(_AuxNet(), plan, x, loss)
    assert check.equal and check.exact
    model = _AuxNet()
    remat.apply(model, plan)
    assert plan.predicted_peak_bytes is not None
    assert remat.measure(model, x, loss, steps=1, progress=False).peak_bytes <= 1.05 * plan.predicted_peak_bytes
