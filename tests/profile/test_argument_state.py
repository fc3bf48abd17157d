"""Blocks that write into an argument they are called with, which later blocks read: a plain dict (a pytree
container) and an object of the model's own (Gemma 3n's layers add their keys and values to a
KVSharingDict: NOTE [ Arguments changed by the call ] in remat.core.probe)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, RecomputeOps
from remat.plan.types import Plan


class Shared:
    """Not a container torch's pytree opens: the runtime snapshots it, and refuses to replay a writer."""

    def __init__(self) -> None:
        self.items: dict[int, torch.Tensor] = {}


class Layer(nn.Module):
    def __init__(self, writes: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.writes = writes

    def forward(self, x: torch.Tensor, shared: Any) -> torch.Tensor:
        items = shared if isinstance(shared, dict) else shared.items
        h = torch.tanh(self.fc(x))
        if self.writes:
            items[len(items)] = h  # a later layer reads it
            return x + h
        return x + h * items[0]


class Model(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layers = nn.ModuleList([Layer(writes=i < 2) for i in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared: Any = {} if self.kind == "dict" else Shared()
        for layer in self.layers:
            x = layer(x, shared)
        return x


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model(x).pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _smallest(prof: remat.Profile) -> Plan:
    try:
        return remat.plan(prof, budget="1%")
    except remat.BudgetInfeasibleError as e:
        return remat.plan(prof, budget=e.min_peak_bytes)


@pytest.mark.parametrize("kind", ["dict", "object"])
def test_blocks_writing_into_an_argument_are_profiled_and_planned_exactly(kind: str) -> None:
    torch.manual_seed(0)
    plain = Model(kind)
    x = torch.randn(64, 32)
    loss_fn = lambda y: y.pow(2).mean()  # noqa: E731
    # Before: the profile's timing under op-level policies handed the writers a copy of the dict (the
    # readers raised KeyError), and its checkpointed timing replayed the object's writers (RematError).
    prof = remat.profile(plain, (x,), loss_fn, repeats=1)
    writers = [bool(b.stateful) for b in prof.block_profiles]
    if kind == "object":  # a replay would write into it again: stateful, kept
        assert writers == [True, True, False, False, False, False]
        assert "argument Shared" in prof.block_profiles[0].stateful
    else:  # a replay gets a dict rebuilt from the call's leaves: nothing to keep
        assert not any(writers)
    plan = _smallest(prof)
    if kind == "object":
        assert not plan.should_checkpoint(0) and not plan.should_checkpoint(1)
    assert any(plan.should_checkpoint(i) for i in range(6))
    model = copy.deepcopy(plain)
    remat.apply(model, plan)
    for a, b in zip(_grads(model, x), _grads(plain, x)):
        assert torch.equal(a, b)
    m = remat.measure(model, (x,), loss_fn, steps=1)
    assert m.peak_bytes <= plan.budget_bytes * 1.05


def test_a_writer_of_a_dict_under_an_op_level_policy_writes_into_the_callers_dict() -> None:
    torch.manual_seed(0)
    plain = Model("dict")
    x = torch.randn(64, 32)
    model = copy.deepcopy(plain)
    ops = (RecomputeOps(0, ()), RecomputeOps(1, ("addmm#0",)), RecomputeOps(2, ()), Keep(3), Keep(4), Keep(5))
    remat.apply(model, Plan(strategy="by hand", blocks=tuple(remat.blocks(model)), ops=ops))
    for _ in range(2):  # before: layer 2 found the dict empty (KeyError)
        for a, b in zip(_grads(model, x), _grads(plain, x)):
            assert torch.equal(a, b)
