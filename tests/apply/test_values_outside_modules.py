"""Values a block reads that live outside its modules' ``__dict__``s, changed by the model's code between the
block's call and the backward: a list or dict a shared plain object holds, edited in place; an object without
a ``__dict__`` (``__slots__``), or slots beside one, rebound by the model or (a tensor) by the block itself; an
object three levels down; a module-level global (a float, a tensor, a list);
an attribute of a user's Python module; a closure cell rebound with ``nonlocal``; the list a
``functools.partial`` was given. A replay computes with the values of the call, so gradients stay bitwise
those of the plain model (NOTE [ Containers and slots of plain objects ] and NOTE [ Values a forward reads
through its code ] in ``remat.core.runtime``); before, a replay read the later values, silently."""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import RecomputeOps
from remat.plan.types import Plan

W = 16

# Module-level state the blocks read (reset by each model's forward at the start of a step).
SCALE = 1.0
GAIN = torch.ones(W)
GLIST = [torch.ones(())]
CONFIG: Any = types.ModuleType("user_config")  # a user's module: ``config.SCALE``
CONFIG.SCALE = 1.0


class _State:
    """A plain object the blocks share."""

    aux: list[torch.Tensor]


class _Slotted:
    __slots__ = ("gain", "n")
    gain: torch.Tensor
    n: int


class _SlotsAndDict:
    """Slots beside a ``__dict__``: the slots are no entries of it."""

    __slots__ = ("gain", "__dict__")
    gain: torch.Tensor


def _closure() -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]:
    gain = torch.ones(())

    def get() -> torch.Tensor:
        return gain

    def put(value: torch.Tensor) -> None:
        nonlocal gain
        gain = value

    return get, put


def _scaled(items: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return h * items[0]


class _Block(nn.Module):
    def __init__(self, mode: str, owner: _Net) -> None:
        super().__init__()
        self.mode, self.state, self.get, self.part = mode, owner.state, owner.get, owner.part
        self.fc, self.act = nn.Linear(W, W), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        mode = self.mode
        if mode == "object_list_item":
            h = h * self.state.items[0]
        elif mode == "object_dict_item":
            h = h * self.state.table["g"]
        elif mode == "object_list_append":
            h = h * self.state.history[-1]
        elif mode in ("slotted_object", "slots_beside_a_dict"):
            h = h * self.state.gain
        elif mode == "slot_the_block_rebinds":  # a running value in a slot, read and rebound by the block
            h = h * self.state.gain
            self.state.gain = self.state.gain * 0.5 + h.detach().mean(0)
        elif mode == "object_three_down":
            h = h * self.state.a.b.gain
        elif mode == "global_float":
            h = h * SCALE
        elif mode == "global_tensor":
            h = h * GAIN
        elif mode == "global_list_item":
            h = h * GLIST[0]
        elif mode == "user_module_attribute":
            h = h * CONFIG.SCALE
        elif mode == "closure_cell":
            h = h * self.get()
        elif mode == "partial_list":
            h = self.part(h)
        return x + torch.tanh(h)


class _Net(nn.Module):
    def __init__(self, mode: str, n: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        slotted = {"slotted_object": _Slotted, "slot_the_block_rebinds": _Slotted, "slots_beside_a_dict": _SlotsAndDict}
        state: Any = slotted.get(mode, _State)()
        if mode not in slotted:
            state.items, state.table, state.history = [torch.ones(())], {"g": torch.ones(())}, [torch.ones(())]
            state.a = _State()
            state.a.b = _State()
        self.state = state
        self.get, self.put = _closure()
        self.plist = [torch.ones(())]
        self.part = functools.partial(_scaled, self.plist)
        self.layers = nn.ModuleList(_Block(mode, self) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global SCALE, GAIN
        mode, state = self.mode, self.state
        SCALE, GAIN, GLIST[0], CONFIG.SCALE = 1.0, torch.ones(W), torch.ones(()), 1.0
        if isinstance(state, (_Slotted, _SlotsAndDict)):
            state.gain = torch.ones(W)
        else:
            state.items[0], state.table["g"], state.history = torch.ones(()), torch.ones(()), [torch.ones(())]
            state.a.b.gain = torch.ones(W)
        self.put(torch.ones(()))
        self.plist[0] = torch.ones(())
        for layer in self.layers:
            x = layer(x)
            d = x.detach()
            if mode == "object_list_item":
                state.items[0] = d.mean()
            elif mode == "object_dict_item":
                state.table["g"] = d.mean()
            elif mode == "object_list_append":
                state.history.append(d.mean())
            elif mode in ("slotted_object", "slots_beside_a_dict"):
                state.gain = state.gain * 0.5 + d.mean(0)
            elif mode == "object_three_down":
                state.a.b.gain = state.a.b.gain * 0.5 + d.mean(0)
            elif mode == "global_float":
                SCALE = SCALE * 0.5 + float(d.mean())
            elif mode == "global_tensor":
                GAIN = GAIN * 0.5 + d.mean(0)
            elif mode == "global_list_item":
                GLIST[0] = d.mean()
            elif mode == "user_module_attribute":
                CONFIG.SCALE = CONFIG.SCALE * 0.5 + float(d.mean())
            elif mode == "closure_cell":
                self.put(d.mean())
            elif mode == "partial_list":
                self.plist[0] = d.mean()
        return x


MODES = [
    "object_list_item",
    "object_dict_item",
    "object_list_append",
    "slotted_object",
    "slot_the_block_rebinds",
    "slots_beside_a_dict",
    "object_three_down",
    "global_float",
    "global_tensor",
    "global_list_item",
    "user_module_attribute",
    "closure_cell",
    "partial_list",
]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _steps(model: nn.Module, x: torch.Tensor, n: int = 3) -> list[torch.Tensor]:
    """Outputs, gradients and parameters after an SGD step, for ``n`` steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: list[torch.Tensor] = []
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        y = model(x)
        _loss(y).backward()
        out += [y.detach().clone(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]
        opt.step()
        out += [p.detach().clone() for p in model.parameters()]
    return out


def _policy(model: nn.Module) -> Plan:
    # An op-level policy on every block: torch's selective checkpoint recomputes the block's forward.
    blocks = tuple(remat.blocks(model, types=(_Block,)))
    ops = tuple(RecomputeOps(i, save=("addmm#0",), recompute=("gelu#0",)) for i in range(len(blocks)))
    return Plan(strategy="by hand", blocks=blocks, ops=ops)


_TARGETS: dict[str, Callable[[nn.Module], remat.Strategy | Plan]] = {
    "full": lambda model: remat.full(),
    "segments": lambda model: remat.segments(2),
    "policy": _policy,
}


def _assert_bitwise(mode: str, target: Callable[[nn.Module], Any], n: int = 4, rows: int = 32) -> None:
    x = torch.randn(rows, W, generator=torch.Generator().manual_seed(1))
    plain = _steps(_Net(mode, n), x)
    model = _Net(mode, n)
    remat.apply(model, target(model))
    planned = _steps(model, x)
    assert len(plain) == len(planned) == 3 * (1 + 2 * 2 * n)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))


# A float global multiplies the block's output: under full() and a policy, no saved tensor depends on it (a
# Python scalar's multiply saves the scalar in the node), so only a segment of two blocks can tell.
_CASES = [(m, t) for m in MODES for t in _TARGETS if not (m == "global_float" and t != "segments")]


@pytest.mark.parametrize(("mode", "target"), _CASES)
def test_replay_sees_values_outside_the_modules_as_at_the_call(mode: str, target: str) -> None:
    _assert_bitwise(mode, _TARGETS[target])


@pytest.mark.parametrize("mode", ["object_list_item", "slotted_object", "global_tensor", "closure_cell"])
def test_smallest_optimal_plan_is_bitwise(mode: str) -> None:
    x = torch.randn(256, W, generator=torch.Generator().manual_seed(1))
    prof = remat.profile(_Net(mode, 6), x, _loss, repeats=1, ops=False)
    with pytest.raises(remat.BudgetInfeasibleError) as info:
        remat.plan(prof, budget="1B")
    plan = remat.plan(prof, budget=info.value.min_peak_bytes)
    assert plan.checkpointed
    _assert_bitwise(mode, lambda model: plan, n=6, rows=256)


class _Counting(nn.Module):
    """Counts its forward runs in a slotted object (what it rebinds itself is left alone: replays count)."""

    def __init__(self, tally: _Slotted) -> None:
        super().__init__()
        self.tally, self.fc = tally, nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tally.n += 1
        return x + torch.tanh(self.fc(x))


def test_a_slot_the_block_rebinds_itself_still_counts_replays() -> None:
    tally = _Slotted()
    tally.n = 0
    model = nn.Sequential(*(_Counting(tally) for _ in range(3)))
    remat.apply(model, remat.full())
    x = torch.randn(8, W)
    for step in range(1, 3):
        _loss(model(x)).backward()
        assert tally.n == 2 * 3 * step  # each block: its call and its replay


def test_values_are_left_as_the_model_set_them() -> None:
    model = _Net("global_tensor")
    remat.apply(model, remat.segments(2))
    x = torch.randn(32, W)
    y = model(x)
    gain = GAIN
    _loss(y).backward()
    assert GAIN is gain  # the replays bound the values of the calls, and put the model's back


class _Appending(nn.Module):
    """Appends an aux loss to a list on a plain object the blocks share (MoE-style)."""

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state, self.fc = state, nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        self.state.aux.append(h.pow(2).mean())
        return x + h


def test_a_replay_appends_nothing_to_an_object_list() -> None:
    # The list holds the plain model's aux losses after the backward: a replay's append (with its graph) is undone.
    def run(model: nn.Module, state: _State) -> list[Any]:
        x = torch.randn(32, W, generator=torch.Generator().manual_seed(1))
        out: list[Any] = []
        for _ in range(2):
            state.aux = []
            y = model(x)
            (_loss(y) + sum(state.aux)).backward()
            out += [len(state.aux), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]
            model.zero_grad(set_to_none=True)
        return out

    def make() -> tuple[nn.Module, _State]:
        torch.manual_seed(0)
        state = _State()
        return nn.Sequential(*(_Appending(state) for _ in range(4))), state

    plain = run(*make())
    model, state = make()
    remat.apply(model, remat.segments(2))
    planned = run(model, state)
    assert [v for v in planned if isinstance(v, int)] == [4, 4]
    assert all(a == b if isinstance(a, int) else torch.equal(a, b) for a, b in zip(plain, planned))


LAST: torch.Tensor | None = None  # a cache the blocks only write (``global LAST; LAST = h``)


class _Caching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global LAST
        h = torch.tanh(self.fc(x))
        LAST = h
        return x + h


def test_a_global_the_blocks_only_write_is_not_held() -> None:
    # Kept per call, each recomputed call would hold the previous block's cache to the backward (charged nowhere).
    # The plain model holds one after the forward (the global); autograd holds the others there (tanh saves them).
    global LAST
    torch.manual_seed(0)
    model = nn.Sequential(*(_Caching() for _ in range(4)))
    remat.apply(model, remat.full())
    x = torch.randn(32, W)
    _loss(model(x)).backward()
    caches: list[Any] = []
    for layer in model:
        x = layer(x)
        assert LAST is not None
        caches.append(weakref.ref(LAST))
    assert sum(ref() is not None for ref in caches) == 1  # the global's: none held by a recorded call
    _loss(x).backward()
    assert LAST is caches[-1]()  # a replay's cache is not left bound
    LAST = None
