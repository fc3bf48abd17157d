"""A tensor attribute a block only writes (a cache: ``self.last_h = fc1(x)``, or ``self.state.last = h`` on a
plain object the blocks share, set after the first block's first call), never read: a recomputed call does not
hold the value it found there (the previous step's cache) to its segment's backward; the plain step frees it
when the forward rebinds it (NOTE [ Tensor attributes a block only writes ] in ``remat.core.runtime``).
Before, every recomputed call held one such cache, charged nowhere (6 of 6 alive after the forward under
``remat.full()``; the CPU profiler of ``remat.measure`` does not see it). The oracle is the plain model: its
gradients, bitwise, and which of the previous step's caches are still alive after the next forward. An
attribute the block reads (an average, created lazily or not) stays kept: ``test_attributes_set_in_forward``."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import RecomputeOps
from remat.plan.types import Plan

W = 16


class _State:
    """A plain object the blocks share (not a module), empty until a block writes its cache."""


class _Block(nn.Module):
    def __init__(self, state: _State, on_object: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(W, 4 * W), nn.Linear(4 * W, W)
        self.state, self.on_object = state, on_object

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.on_object:
            self.state.last = h  # written, never read; rebound by the next block
        else:
            self.last_h = h  # written, never read; rebound by the next step
        return x + self.fc2(torch.tanh(h))


class _Net(nn.Module):
    def __init__(self, on_object: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.state = _State()
        self.layers = nn.ModuleList(_Block(self.state, on_object) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def caches(self) -> list[torch.Tensor]:
        if self.layers[0].on_object:
            return [self.state.last]
        return [layer.last_h for layer in self.layers]


def _policy(model: nn.Module) -> Plan:
    # An op-level policy on every block: torch's selective checkpoint recomputes its forward.
    blocks = tuple(remat.blocks(model, types=(_Block,)))
    ops = tuple(RecomputeOps(i, save=("addmm#0",), recompute=("tanh#0",)) for i in range(len(blocks)))
    return Plan(strategy="by hand", blocks=blocks, ops=ops)


_TARGETS: dict[str, Callable[[nn.Module], remat.Strategy | Plan]] = {
    "full": lambda model: remat.full(),
    "segments": lambda model: remat.segments(2),
    "policy": _policy,
}


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _steps(model: _Net, x: torch.Tensor) -> tuple[list[list[torch.Tensor]], int]:
    """Gradients of 3 steps, and how many of step 2's caches are alive after step 3's forward."""
    grads, alive = [], -1
    for step in range(3):
        model.zero_grad(set_to_none=True)
        refs = [weakref.ref(t) for t in model.caches()] if step == 2 else []
        out = model(x)
        if refs:
            gc.collect()
            alive = sum(ref() is not None for ref in refs)
        _loss(out).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    return grads, alive


@pytest.mark.parametrize("target", list(_TARGETS))
@pytest.mark.parametrize("on_object", [False, True], ids=["module", "object"])
def test_cache_written_only_is_not_held_and_gradients_are_bitwise(on_object: bool, target: str) -> None:
    x = torch.randn(64, W, generator=torch.Generator().manual_seed(1))
    plain_grads, plain_alive = _steps(_Net(on_object), x)
    model = _Net(on_object)
    remat.apply(model, _TARGETS[target](model))
    grads, alive = _steps(model, x)
    assert alive == plain_alive == 0  # before: 6 (module), 1 (object: the first block's, set after its first call)
    for got, want in zip(grads, plain_grads):
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


class _ReadLater(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(W, 4 * W), nn.Linear(4 * W, W)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.fc1(x)
        if self.calls >= 3:  # not read by the first call that found it (the second)
            h = h * self.prev.mean()
        self.prev = h.detach() * 0.5  # rebound by every call; nothing else holds the old one
        return x + self.fc2(torch.tanh(h))


def test_module_tensor_first_read_on_a_later_call_is_refused() -> None:
    # Not read by the first call that found a tensor there, so kept weakly; read by a later call whose forward
    # rebinds it: its recomputation is refused (the plain model computes with the tensor at the call, which
    # nothing holds any more), never run with another value.
    torch.manual_seed(0)
    model = nn.Sequential(*[_ReadLater() for _ in range(3)])
    remat.apply(model, remat.full())
    x = torch.randn(8, W)
    for _ in range(2):
        _loss(model(x)).backward()
    with pytest.raises(remat.RematError, match=r"tensor attribute 'prev' of a module of a block, .* pass it to the"):
        _loss(model(x)).backward()


class _State2:
    """A plain object the blocks share."""


class _GatedRead(nn.Module):
    def __init__(self, state: _State2, on_object: bool, use: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(W, 4 * W), nn.Linear(4 * W, W)
        self.state, self.on_object, self.use = state, on_object, use
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        owner = self.state if self.on_object else self
        h = self.fc1(x)
        prev = getattr(owner, "prev", None)
        if self.calls >= 3:  # not read by the first call that finds it
            if self.use == "isinstance" and isinstance(prev, torch.Tensor):
                h = h + prev.mean()  # adds nothing autograd saves: a skipped read changes no saved tensor
            elif self.use == "arithmetic":
                h = h + prev * 0.5
        owner.prev = h.detach() * 0.5  # rebound by every call; nothing else holds the old one
        return x + self.fc2(torch.tanh(h))


@pytest.mark.parametrize("use", ["isinstance", "arithmetic"])
@pytest.mark.parametrize("on_object", [False, True], ids=["module", "object"])
def test_tensor_gone_by_the_replay_is_refused_however_it_is_used(on_object: bool, use: str) -> None:
    # The stand-in for a tensor kept weakly that died passes isinstance(..., torch.Tensor) as the tensor did
    # and refuses Python arithmetic: before, the replay skipped the read behind the isinstance test and
    # computed other gradients silently (object: 11 of 36 off), and arithmetic raised a bare TypeError.
    torch.manual_seed(0)
    state = _State2()
    state.prev = torch.ones(64, 4 * W)  # present at the first call: not read there
    model = nn.Sequential(*[_GatedRead(state, on_object, use) for _ in range(3)])
    remat.apply(model, remat.full())
    x = torch.randn(64, W)
    for _ in range(2):
        _loss(model(x)).backward()
    with pytest.raises(remat.RematError, match=r"tensor attribute 'prev' of (a module|a plain object)"):
        _loss(model(x)).backward()
