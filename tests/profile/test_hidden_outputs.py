"""Tensors a block hands on where pytree does not look: container subclasses, ``__slots__`` objects,
closures, ``functools.partial``, sparse layouts. The profile must count their bytes (left out, the
chain model saw nothing between blocks and plans measured 1.08-1.16x their budget), and a generator,
which cannot be read without consuming it, is refused."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat

D, N = 64, 256


class Pair(tuple):  # type: ignore[type-arg]  # a tuple subclass pytree does not know (no namedtuple)
    pass


class Slots:
    __slots__ = ("g", "h")

    def __init__(self, h: torch.Tensor, g: torch.Tensor) -> None:
        self.h, self.g = h, g


WRAP: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], Any], Callable[[Any], Any]]] = {
    "tuple subclass": (lambda h, g: Pair((h, g)), lambda o: (o[0], o[1])),
    "__slots__ object": (lambda h, g: Slots(h, g), lambda o: (o.h, o.g)),
    "closure": (lambda h, g: lambda: (h, g), lambda o: o()),
    "functools.partial": (lambda h, g: functools.partial(lambda a, b: (a, b), h, g), lambda o: o()),
    "generator": (lambda h, g: (t for t in (h, g)), lambda o: tuple(o)),
}


class Wrapped(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> Any:
        h = x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return WRAP[self.kind][0](h, torch.tanh(h))


class WrappedNet(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Wrapped(kind) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            a, b = WRAP[layer.kind][1](layer(x))
            x = a + b
        return x


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out**2).mean()


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(model(x)).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _smallest_plan(prof: remat.Profile) -> remat.Plan:
    with pytest.raises(remat.BudgetInfeasibleError) as e:
        remat.plan(prof, budget="1B")
    return remat.plan(prof, budget=e.value.min_peak_bytes)


def _held_to_budget(model: nn.Module, x: torch.Tensor, prof: remat.Profile, plan: remat.Plan) -> None:
    want = _grads(copy.deepcopy(model), x)
    remat.apply(model, plan)
    try:
        m = remat.measure(model, x, _loss, steps=1, progress=False)
        got = _grads(model, x)
    finally:
        remat.remove(model)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert m.peak_bytes <= plan.budget_bytes * 1.05, (m.peak_bytes / plan.budget_bytes, plan.describe())


@pytest.mark.parametrize("kind", ["tuple subclass", "__slots__ object", "closure", "functools.partial"])
def test_an_output_in_a_container_pytree_does_not_open_is_counted_and_plans_keep_their_budget(kind: str) -> None:
    torch.manual_seed(0)
    model, x = WrappedNet(kind), torch.randn(N, D)
    prof = remat.profile(model, x, _loss, repeats=1, progress=False)
    assert [bp.output_bytes for bp in prof.block_profiles] == [2 * N * D * 4] * 4
    _held_to_budget(model, x, prof, _smallest_plan(prof))


def test_a_block_returning_a_generator_is_refused_by_the_profile() -> None:
    torch.manual_seed(0)
    model, x = WrappedNet("generator"), torch.randn(N, D)
    with pytest.raises(remat.RematError, match=r"returns a generator \(an iterator\).*return a tuple or a list"):
        remat.profile(model, x, _loss, repeats=1, progress=False)
    remat.apply(model, remat.full())  # a plan that needs no profile still runs it, as the plain model
    try:
        got = _grads(model, x)
    finally:
        remat.remove(model)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model, x), got, strict=True))


class Sparse(nn.Module):
    def __init__(self, layout: str) -> None:
        super().__init__()
        self.layout = layout
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.layout != torch.strided:
            x = x.to_dense()
        h = torch.relu(self.fc(x))
        return h.to_sparse() if self.layout == "coo" else h.to_sparse_csr()


class SparseNet(nn.Module):
    def __init__(self, layout: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Sparse(layout) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.to_dense()


def _sparse_bytes(t: torch.Tensor) -> int:
    if t.layout is torch.sparse_coo:
        parts = [t._indices(), t._values()]
    else:
        parts = [t.crow_indices(), t.col_indices(), t.values()]
    return sum(p.untyped_storage().nbytes() for p in parts)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_tensors_between_blocks_are_counted_by_their_indices_and_values(layout: str) -> None:
    torch.manual_seed(0)
    model, x = SparseNet(layout), torch.randn(N, D)
    outs = []
    hooks = [layer.register_forward_hook(lambda _m, _a, out: outs.append(out.detach())) for layer in model.layers]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    prof = remat.profile(model, x, _loss, repeats=1, progress=False)
    assert [bp.output_bytes for bp in prof.block_profiles] == [_sparse_bytes(o) for o in outs]
    _held_to_budget(model, x, prof, remat.plan(prof, budget="80%"))


class PairIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, s: Pair) -> Pair:
        x = s[0] + s[1]
        h = x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return Pair((h, torch.tanh(h)))


class PairNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([PairIn() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = Pair((x, x))
        for layer in self.layers:
            s = layer(s)
        return s[0]


def test_an_argument_in_a_container_pytree_does_not_open_is_counted_as_the_blocks_input() -> None:
    torch.manual_seed(0)
    model, x = PairNet(), torch.randn(N, D)
    prof = remat.profile(model, x, _loss, repeats=1, progress=False)
    # Each block takes the pair the block before returned (the first: x twice, one storage).
    assert [bp.input_bytes for bp in prof.block_profiles] == [N * D * 4] + [2 * N * D * 4] * 3
    for plan in (remat.plan(prof, budget="80%"), _smallest_plan(prof)):
        _held_to_budget(model, x, prof, plan)
