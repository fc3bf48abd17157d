"""Attributes and hooks that user code changes between a forward and its backward, or between two forwards
before one backward: a replay runs with those of its call (NOTE [ State under recomputation ])."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

import remat
from remat.core.ops import Keep, RecomputeOps
from remat.plan.types import Plan


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.drop, self.fc2 = nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16)
        self.scale = 1.0
        self.active = ["a"]  # like peft's active adapter names: a list a forward reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act(self.fc1(x)))
        if "b" in self.active:
            h = h * 0.5
        return x + self.scale * self.fc2(h)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_Layer(), _Layer(), _Layer(), nn.Linear(16, 1))


def _policy(model: nn.Module) -> Plan:
    ops = (RecomputeOps(0, save=("addmm#0",), recompute=("gelu#0",)), Keep(1), RecomputeOps(2, save=(), recompute=()))
    return Plan(strategy="by hand", blocks=tuple(remat.blocks(model, types=_Layer)), ops=ops)


def _set_p(m: nn.Module) -> None:
    m[0].drop.p = 0.5


def _set_approximate(m: nn.Module) -> None:
    for layer in m[:3]:
        layer.act.approximate = "tanh"


def _set_scale(m: nn.Module) -> None:
    m[1].scale = 3.0


def _edit_list(m: nn.Module) -> None:
    m[2].active.append("b")  # in place: the call's value must have been copied


def _add_hook(m: nn.Module) -> None:
    for layer in m[:3]:
        layer.fc1.register_forward_hook(lambda mod, args, out: out * 1.25)


CHANGES: dict[str, Callable[[nn.Module], None]] = {
    "dropout p": _set_p,
    "GELU approximate": _set_approximate,
    "a float of the block": _set_scale,
    "a list edited in place": _edit_list,
    "a sub-module hook added": _add_hook,
}


def _grads(model: nn.Module, change: Callable[[nn.Module], None], twice: bool) -> list[torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(8, 16)
    loss = model(x).square().mean()
    change(model)
    if twice:  # a second forward with the changed state, then one backward through both
        loss = loss + model(x).square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("twice", [False, True], ids=["forward-backward", "two forwards"])
@pytest.mark.parametrize("change", list(CHANGES), ids=str)
@pytest.mark.parametrize("how", ["full", "segments(2)", "policy"])
def test_a_change_after_the_call_does_not_reach_its_replay(how: str, change: str, twice: bool) -> None:
    # Before, every one of these gave other gradients, silently (helper-38: dropout p 0.064, peft's
    # set_adapter between two forwards 0.064, a hook added before the backward 0.017).
    base = _model()
    plain = _grads(copy.deepcopy(base), CHANGES[change], twice)
    model = copy.deepcopy(base)
    plan = {"full": remat.full(), "segments(2)": remat.segments(2), "policy": _policy(model)}[how]
    remat.apply(model, plan)
    got = _grads(model, CHANGES[change], twice)
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))


@pytest.mark.parametrize("how", ["full", "policy"])
def test_a_global_hook_around_the_forward_only_runs_in_its_replay(how: str) -> None:
    def grads(model: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        handle = register_module_forward_hook(lambda mod, args, out: out * 1.25 if isinstance(mod, nn.Linear) else None)
        try:
            loss = model(torch.randn(8, 16)).square().mean()
        finally:
            handle.remove()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    base = _model()
    plain = grads(copy.deepcopy(base))
    model = copy.deepcopy(base)
    remat.apply(model, remat.full() if how == "full" else _policy(model))
    assert all(torch.equal(a, b) for a, b in zip(plain, grads(model), strict=True))
    assert not torch.nn.modules.module._global_forward_hooks  # and it stays removed


def test_a_hook_removed_before_the_backward_runs_in_the_replay_and_stays_removed() -> None:
    base = _model()

    def grads(model: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        handles = [layer.fc1.register_forward_hook(lambda mod, args, out: out + 1.0) for layer in model[:3]]
        loss = model(torch.randn(8, 16)).square().mean()
        for h in handles:
            h.remove()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads(copy.deepcopy(base))
    model = copy.deepcopy(base)
    remat.apply(model, remat.full())
    assert all(torch.equal(a, b) for a, b in zip(plain, grads(model), strict=True))
    assert not any(layer.fc1._forward_hooks for layer in model[:3])


class _Owned(nn.Module):
    """Reads an int of a module it refers to without owning it (a back-reference to the model)."""

    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        object.__setattr__(self, "owner", owner)  # not a sub-module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) * (1 + 0.1 * self.owner.step))  # tanh saves its output


class _Owner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.layers = nn.ModuleList(_Owned(self) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        self.step += 1  # a step counter, bumped after the layers ran and before the backward
        return x


@pytest.mark.parametrize("strategy", [remat.full(), remat.segments(2)], ids=["full", "segments2"])
def test_an_int_of_a_module_a_block_refers_to_without_owning_it_is_replayed_as_at_the_call(
    strategy: remat.Strategy,
) -> None:
    def grads(apply: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _Owner()
        if apply:
            remat.apply(model, strategy)
        model(torch.randn(8, 16)).pow(2).sum().backward()
        return [p.grad for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads(False), grads(True), strict=True))


class _Aux(nn.Module):
    """Binds an auxiliary loss to itself in its forward (MoE-style), which the model sums after the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        self.aux_loss = h.pow(2).mean()
        return torch.sigmoid(h)  # saves after the binding: a recomputation runs past it (torch's early stop)


@pytest.mark.parametrize(
    "strategy", [remat.full(), remat.segments(2), "policies"], ids=["full", "segments2", "policies"]
)
def test_what_a_replay_binds_to_its_modules_is_put_back_to_the_forwards(strategy: remat.Strategy | str) -> None:
    # The replay's aux_loss would hold the replay's graph (every tensor it saved) to the next forward; under
    # op-level policies, torch's selective checkpoint recomputes the block (RecurrentGemma's recurrent_states).
    torch.manual_seed(0)
    model = nn.Sequential(*(_Aux() for _ in range(4)))
    model(torch.randn(8, 16))  # a step before apply: each layer already holds an aux_loss tensor
    if strategy == "policies":
        strategy = Plan(
            strategy="by hand", blocks=tuple(remat.blocks(model)), ops=tuple(RecomputeOps(i, ()) for i in range(4))
        )
    remat.apply(model, strategy)
    out = model(torch.randn(8, 16))
    bound = [layer.aux_loss for layer in model]
    (out.pow(2).sum() + sum(bound)).backward()
    assert all(layer.aux_loss is b for layer, b in zip(model, bound, strict=True))


class _AuxInDict(nn.Module):
    """Writes its auxiliary loss into a dict attribute (``self.store["aux"] = ...``), the model sums them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.store: dict[str, torch.Tensor] = {}
        self.history: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        self.store["aux"] = h.pow(2).mean()
        self.history.append(self.store["aux"].detach())
        return torch.sigmoid(h)


@pytest.mark.parametrize(
    "strategy", [remat.full(), remat.segments(2), "policies"], ids=["full", "segments2", "policies"]
)
def test_what_a_replay_writes_into_its_modules_dicts_and_lists_is_put_back(strategy: remat.Strategy | str) -> None:
    # The replay's tensor left in store["aux"] held the replay's graph to the next step (1.42x the budget).
    torch.manual_seed(0)
    model = nn.Sequential(*(_AuxInDict() for _ in range(4)))
    if strategy == "policies":
        strategy = Plan(
            strategy="by hand", blocks=tuple(remat.blocks(model)), ops=tuple(RecomputeOps(i, ()) for i in range(4))
        )
    remat.apply(model, strategy)
    for step in range(1, 3):  # the first call after apply learns; the second is a plain call
        out = model(torch.randn(8, 16))
        written = [layer.store["aux"] for layer in model]
        (out.pow(2).sum() + sum(written)).backward()
        assert all(layer.store["aux"] is w for layer, w in zip(model, written, strict=True))
        assert [len(layer.history) for layer in model] == [step] * 4  # one per forward, none per replay
