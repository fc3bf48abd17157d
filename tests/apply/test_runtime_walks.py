"""The runtime's per-call cost: a member's module tree is walked once per call and once per replay (NOTE [ One
walk per call ] in remat.core.runtime), not once per thing recorded about it (its buffers, its parameters'
``requires_grad``, its hooks, its attributes: seven walks per recorded call and replay before), with the
gradients and state of the plain model, bitwise."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.plan.types import Plan


class _Tally:
    """Counts in an object of its own without a ``__dict__`` (a replay sets a block's plain attributes, and those of
    the plain objects its modules hold, back to their values at the call: NOTE [ Attributes other code sets ])."""

    __slots__ = ("walks", "runs")

    def __init__(self) -> None:
        self.walks = 0
        self.runs = 0


class _Block(nn.Module):
    """A residual block with dropout, counting the walks of its module tree (``modules()``, ``named_buffers()``,
    ``parameters()`` all go through ``named_modules``) and its forward runs, replays included. Its norm is a
    LayerNorm: a saved tensor edited since the call (BatchNorm's running statistics, saved by its kernel and
    put back around a nested replay) is looked into with a walk of its own, in the backward only."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.act, self.drop, self.fc2 = nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)
        self.tally = _Tally()

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        self.tally.walks += 1
        return super().named_modules(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tally.runs += 1
        return x + self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(_Block(8) for _ in range(4)), nn.Linear(8, 1))


def _plan(model: nn.Module, kind: str) -> Plan:
    blocks = tuple(remat.blocks(model, types=_Block))
    if kind == "one per block":
        ops: tuple[Any, ...] = tuple(Recompute(i, i + 1, (Keep(i),)) for i in range(4))
    elif kind == "one segment":
        ops = (Recompute(0, 4, tuple(Keep(i) for i in range(4))),)
    else:  # nested: the outer replay records the inner segment again
        ops = (Recompute(0, 4, (Keep(0), Recompute(1, 3, (Keep(1), Keep(2))), Keep(3))),)
    return Plan(strategy=kind, blocks=blocks, ops=ops)


def _step(model: nn.Module, params: list[nn.Parameter], x: torch.Tensor, seed: int) -> list[torch.Tensor]:
    # ``params`` listed once: model.parameters() walks every block's tree too.
    torch.manual_seed(seed)
    for p in params:
        p.grad = None
    model(x).pow(2).mean().backward()
    return [p.grad.clone() for p in params if p.grad is not None]


@pytest.mark.parametrize("kind", ["one per block", "one segment", "nested"])
def test_one_walk_per_call_and_per_replay_with_plain_gradients(kind: str) -> None:
    plain = _model()
    model = copy.deepcopy(plain)
    remat.apply(model, _plan(model, kind))
    x = torch.randn(16, 8)
    blocks = [m for m in model if isinstance(m, _Block)]
    plain_params, params = list(plain.parameters()), list(model.parameters())
    for seed in range(3):
        for b in blocks:
            b.tally.walks = b.tally.runs = 0
        ref, got = _step(plain, plain_params, x, seed), _step(model, params, x, seed)
        counts = [(b.tally.walks, b.tally.runs) for b in blocks]
        assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))
        if seed == 0:
            continue  # the first call of each member learns what it changes and draws: walks of its own
        for walks, runs in counts:
            # Each run is a call by the model or a replay in the backward (2 per step, 3 for a nested member).
            assert runs >= 2
            assert walks == runs, (kind, counts)
