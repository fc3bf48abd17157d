"""A tensor a recomputed block saved, edited in place before the backward (NOTE [ Saved tensors edited before
the backward ] in remat.core.runtime): the plain backward raises, remat's must too, never recompute with it."""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Op, Recompute, RecomputeOps
from remat.plan.types import Plan

SCALE = torch.tensor([1.5, 2.0, 0.5, 1.0])  # a global the blocks read


class Scaled(nn.Module):
    """``tanh(fc(x)) * s``: the product saves ``s``, a global or a tensor attribute that is not a buffer."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.source = source
        self.scale = torch.tensor([1.5, 2.0, 0.5, 1.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * (SCALE if self.source == "global" else self.scale)


def _plans(kind: str) -> tuple[Op, ...]:
    if kind == "segment":
        return (Recompute(0, 4, (Keep(0), Keep(1), Keep(2), Keep(3))),)
    if kind == "nested":
        return (Recompute(0, 4, (Keep(0), Recompute(1, 3, (Keep(1), Keep(2))), Keep(3))),)
    # Op-level policies, one caching nothing, one caching the matmul.
    return tuple(RecomputeOps(i, ("addmm#0",) if i % 2 else ()) for i in range(4))


def _step(model: nn.Module, x: torch.Tensor, edit: bool) -> list[torch.Tensor]:
    out = model(x)
    scales = [SCALE] if model[0].source == "global" else [b.scale for b in model]
    if edit:
        for s in scales:
            s.mul_(2)  # other code, between the forward and the backward
    try:
        out.pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]
    finally:
        if edit:
            for s in scales:
                s.div_(2)
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["segment", "nested", "policies"])
@pytest.mark.parametrize("source", ["global", "attribute"])
def test_a_saved_tensor_edited_before_the_backward_is_a_remat_error_as_the_plain_backward_fails(
    source: str, kind: str
) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(*[Scaled(source) for _ in range(4)])
    x = torch.randn(8, 4)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _step(plain, x, edit=True)  # the oracle: autograd's own version check
    model = copy.deepcopy(plain)
    remat.apply(model, Plan(strategy="by hand", blocks=tuple(remat.blocks(model)), ops=_plans(kind)))
    with pytest.raises(remat.RematError, match=r"used in its forward .* edited in place after the forward"):
        _step(model, x, edit=True)  # before: gradients computed with the doubled scale, silently
    for a, b in zip(_step(model, x, edit=False), _step(plain, x, edit=False)):
        assert torch.equal(a, b)


class Workspace(nn.Module):
    """Writes its input into a tensor of its own (not a buffer) and computes from it: each call, replays too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.ws = torch.zeros(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ws.copy_(x.detach())
        return torch.tanh(self.fc(x)) * self.ws


@pytest.mark.parametrize("kind", ["segment", "nested", "policies"])
def test_a_tensor_the_block_itself_writes_again_in_its_replay_is_no_edit(kind: str) -> None:
    # The replay's own write moves the version after the check: only edits between the forward and the
    # replay count, so this recomputes as before, bitwise.
    torch.manual_seed(0)
    plain = nn.Sequential(*[Workspace() for _ in range(4)])
    x = torch.randn(8, 4)
    model = copy.deepcopy(plain)
    ops = _plans(kind) if kind != "policies" else tuple(RecomputeOps(i, ()) for i in range(4))
    remat.apply(model, Plan(strategy="by hand", blocks=tuple(remat.blocks(model)), ops=ops))
    for _ in range(2):
        for a, b in zip(_step_plain(model, x), _step_plain(plain, x)):
            assert torch.equal(a, b)


def _step_plain(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model(x).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_running_statistics_updated_by_a_second_call_before_the_backward_are_no_edit() -> None:
    # A siamese step through BatchNorm: the second call updates the statistics the first saved; remat
    # restores them around each replay (NOTE [ State under recomputation ]), as before.
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()) for _ in range(3)])
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    model = copy.deepcopy(plain)
    segment = (Recompute(0, 3, (Keep(0), Keep(1), Keep(2))),)
    remat.apply(model, Plan(strategy="by hand", blocks=tuple(remat.blocks(model)), ops=segment))

    def step(m: nn.Module) -> list[torch.Tensor]:
        (m(a) - m(b)).pow(2).sum().backward()
        grads = [p.grad.clone() for p in m.parameters()] + [t.clone() for t in m.buffers()]
        m.zero_grad(set_to_none=True)
        return grads

    for u, v in zip(step(model), step(plain)):
        assert torch.equal(u, v)


SHIFT = torch.tensor([0.5, -1.0, 0.25, 2.0])


class Shifted(nn.Module):
    """``tanh(fc(x) + shift)``: the add saves nothing, so the plain backward never sees an edit of ``shift``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) + SHIFT)


@pytest.mark.parametrize("kind", ["segment", "nested", "policies"])
def test_a_tensor_read_but_not_saved_and_edited_before_the_backward_is_a_remat_error(kind: str) -> None:
    # The plain backward uses the forward's tanh output and succeeds; a replay would add the edited shift.
    torch.manual_seed(0)
    plain = nn.Sequential(*[Shifted() for _ in range(4)])
    x = torch.randn(8, 4)
    model = copy.deepcopy(plain)
    remat.apply(model, Plan(strategy="by hand", blocks=tuple(remat.blocks(model)), ops=_plans(kind)))
    for _ in range(3):  # the first call learns what the block reads; later calls are checked the same
        for m in (plain, model):
            out = m(x)
            SHIFT.add_(1.0)
            try:
                if m is plain:
                    out.pow(2).sum().backward()
                else:
                    with pytest.raises(remat.RematError, match=r"used in its forward .* edited in place after"):
                        out.pow(2).sum().backward()  # before: gradients from the shifted replay, silently
            finally:
                SHIFT.sub_(1.0)
                m.zero_grad(set_to_none=True)
    for a, b in zip(_step_plain(model, x), _step_plain(plain, x)):
        assert torch.equal(a, b)


# A review of the check (helper-55): edits it missed, and a workspace it refused.

_DEPTH = [0]


class _CleansUpInExcept(nn.Module):
    """Puts a counter back in ``except Exception`` / ``else``, not ``finally``; the replay stops inside."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 if _DEPTH[0] == 0 else 0.5
        _DEPTH[0] += 1
        try:
            y = self.fc2(torch.tanh(self.fc(x)) * scale)
            torch.sigmoid(y).sum()  # one save after the last one the backward needs: the replay stops before it
        except Exception:
            _DEPTH[0] -= 1
            raise
        else:
            _DEPTH[0] -= 1
        return y


def test_the_replays_early_stop_runs_the_models_except_exception_cleanup() -> None:
    # As a BaseException, the stop skipped it: the counter stayed raised and the next steps differed.
    torch.manual_seed(0)
    plain = nn.Sequential(*[_CleansUpInExcept() for _ in range(3)])
    model = copy.deepcopy(plain)
    remat.apply(model, remat.full())
    x = torch.randn(8, 4)
    for _ in range(2):
        for a, b in zip(_step_plain(model, x), _step_plain(plain, x)):
            assert torch.equal(a, b)
        assert _DEPTH[0] == 0


class _SharedShift(nn.Module):
    def __init__(self, shift: torch.Tensor) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.shared = [shift]  # not an attribute torch registers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) + self.shared[0])


class _AdvancesBetween(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shift = torch.zeros(4)
        self.blocks = nn.ModuleList(_SharedShift(self.shift) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        self.shift.add_(1.0)  # advanced in place between the layers: block 1 reads it after
        return self.blocks[1](x)


def test_an_edit_between_two_blocks_that_read_a_tensor_is_not_excused_by_the_later_read() -> None:
    # Block 1's read noted the edited version, which excused block 0's edit: silently off.
    torch.manual_seed(0)
    model = _AdvancesBetween()
    remat.apply(model, remat.full())
    with pytest.raises(remat.RematError, match="edited in place after the forward"):
        model(torch.randn(3, 4)).pow(2).sum().backward()


class _Accumulates(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.acc = torch.zeros(4)  # a running average kept in a plain tensor attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return torch.tanh(self.fc(x) - self.acc)


def test_a_block_updating_a_plain_tensor_from_its_own_values_is_refused() -> None:
    # Its replay applied the update a second time and computed with it: gradients and state off, silently.
    torch.manual_seed(0)
    model = nn.Sequential(*[_Accumulates() for _ in range(3)])
    remat.apply(model, remat.full())
    for _ in range(2):  # every call, not only the first
        with pytest.raises(remat.RematError, match="updates in place, from its own values"):
            model(torch.randn(8, 4))


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) + self.mask)  # the add does not save the mask


@pytest.mark.parametrize("how", ["buffer in place", "data assigned"])
def test_a_buffer_or_a_tensors_data_changed_before_the_backward_is_an_edit(how: str) -> None:
    # A buffer the replay does not restore (a pruning schedule's mask) and ``t.data = ...`` (no version
    # bump) were replayed with the new values, silently.
    torch.manual_seed(0)
    model = nn.Sequential(*[_Masked() for _ in range(3)])
    remat.apply(model, remat.full())
    out = model(torch.randn(8, 4))
    for block in model:
        if how == "buffer in place":
            block.mask[0] = 0.0
        else:
            block.mask.data = block.mask + 1.0
    with pytest.raises(remat.RematError, match="edited in place after the forward"):
        out.pow(2).sum().backward()


class _SliceWorkspace(nn.Module):
    def __init__(self, ws: torch.Tensor, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.ws, self.how = ws, how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.how == "setitem":
            self.ws[:n] = x.detach()
        else:
            self.ws.narrow(0, 0, n).copy_(x.detach())
        return torch.tanh(self.fc(x) + self.ws[:n])


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("how", ["setitem", "narrow"])
def test_a_workspace_filled_through_a_view_is_no_read(how: str, shared: bool) -> None:
    # Each call fills it before reading (the replay too); called twice per step, the second fill moved its
    # version: a needless RematError before.
    torch.manual_seed(0)
    ws = torch.zeros(8, 4)
    plain = nn.Sequential(*[_SliceWorkspace(ws if shared else torch.zeros(8, 4), how) for _ in range(3)])
    model = copy.deepcopy(plain)
    remat.apply(model, remat.full())
    a, b = torch.randn(8, 4), torch.randn(8, 4)

    def step(m: nn.Module) -> list[torch.Tensor]:
        (m(a) - m(b)).pow(2).sum().backward()
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return grads

    for _ in range(2):
        for u, v in zip(step(model), step(plain)):
            assert torch.equal(u, v)


# A second review of the check (helper-58): partial fills, updates written as fills, shape-only reads, stores
# nested in a module's dict.


class _PartialFill(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.mem = torch.zeros(16, 4)  # rows 0..7 this step's, 8..15 older memory

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mem[:8] = x.detach()  # fills part of it: the rest is still read
        return torch.tanh(self.fc(x) + self.mem.sum(0))


def test_a_partly_filled_tensor_is_still_a_read() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[_PartialFill() for _ in range(3)])
    remat.apply(model, remat.full())
    out = model(torch.randn(8, 4))
    for block in model:
        block.mem[8:].add_(1.0)  # other code edits the older memory: the replay read it, silently, before
    with pytest.raises(remat.RematError, match="edited in place after the forward"):
        out.pow(2).sum().backward()


class _Updates(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.acc = torch.zeros(4)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = 0.1 * x.detach().mean(0)
        if self.how == "out":
            torch.add(self.acc, s, out=self.acc)
        elif self.how == "copy":
            self.acc.copy_(0.9 * self.acc + s)  # an EMA written as a fill
        else:  # read first, then updated
            y = torch.tanh(self.fc(x) + self.acc)
            self.acc.add_(s)
            return y
        return torch.tanh(self.fc(x) - self.acc)


@pytest.mark.parametrize("how", ["out", "copy", "read then add"])
def test_updates_written_as_fills_or_after_a_read_are_refused(how: str) -> None:
    # Each replay updated the tensor once more and computed with it: gradients and state off, silently.
    torch.manual_seed(0)
    model = nn.Sequential(*[_Updates(how) for _ in range(3)])
    remat.apply(model, remat.full())
    with pytest.raises(remat.RematError, match="updates in place, from its own values"):
        model(torch.randn(8, 4))


_G = torch.randn(8, 4)


class _ShapeOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) + torch.zeros_like(_G))  # reads _G's shape only


def test_a_tensor_whose_shape_only_is_read_may_change() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(*[_ShapeOnly() for _ in range(3)])
    model = copy.deepcopy(plain)
    remat.apply(model, remat.full())
    x = torch.randn(8, 4)
    grads = []
    for m in (plain, model):
        out = m(x)
        _G.add_(1.0)  # a needless RematError before
        grads.append(_step_after(m, out))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _step_after(m: nn.Module, out: torch.Tensor) -> list[torch.Tensor]:
    out.pow(2).sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    return grads


class _NestedStore(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.store: Any = {"aux": []} if kind == "dict of list" else collections.defaultdict(list)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        self.store["aux"].append(h.pow(2).mean())  # an aux loss collected for logging
        return h


@pytest.mark.parametrize("kind", ["dict of list", "defaultdict"])
def test_what_a_replay_appends_to_a_store_inside_a_module_attribute_is_put_back(kind: str) -> None:
    # One level deeper than a dict attribute: each replay left its entry, holding its graph.
    torch.manual_seed(0)
    model = nn.Sequential(*[_NestedStore(kind) for _ in range(4)])
    remat.apply(model, Plan(strategy="by hand", blocks=tuple(remat.blocks(model)), ops=_plans("segment")))
    for step in range(1, 3):
        model(torch.randn(32, 16)).sum().backward()  # one segment: its replay runs blocks 0-2 through
        assert [len(b.store["aux"]) for b in model] == [step] * 4


_SCRATCH = torch.zeros(64, 16)


class _FillsPart(nn.Module):
    """Fills part of a shared scratch tensor through a view, then uses only that part (PyG's aggregation
    modules do the same): the replay refills it, so the part is the call's own, no read and no update."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "copy":
            w = _SCRATCH[: x.shape[0]]
            w.copy_(self.a(x).detach())
            return x + torch.tanh(self.a(x)) * w.sum()
        w = _SCRATCH.narrow(0, 0, x.shape[0])
        w.zero_()
        w.add_(self.a(x).detach())
        return x + torch.tanh(self.a(x)) + w


@pytest.mark.parametrize("how", ["copy", "zero then add"])
def test_a_part_of_a_shared_scratch_tensor_filled_and_used_alone_is_no_read(how: str) -> None:
    # Refused after the partial-fill fix (the next layer's fill moved the version; add_ looked like an
    # update): PyG's split GCN/GAT/GIN profiles were refused (helper-57).
    torch.manual_seed(0)
    plain = nn.Sequential(*[_FillsPart(how) for _ in range(3)])
    model = copy.deepcopy(plain)
    remat.apply(model, remat.full())
    x = torch.randn(4, 16)
    for _ in range(2):
        for a, b in zip(_step_plain(model, x), _step_plain(plain, x)):
            assert torch.equal(a, b)
