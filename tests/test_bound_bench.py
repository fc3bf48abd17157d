"""benchmarks/bound.py: the fractional knapsack against brute force over every subset."""

from __future__ import annotations

import itertools
import random
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.benchmark_scripts import load


@pytest.fixture(scope="module")
def bound() -> ModuleType:
    return load("bound")


@pytest.mark.parametrize("seed", range(20))
def test_least_ms_is_a_lower_bound_within_one_item_of_the_best_subset(bound: ModuleType, seed: int) -> None:
    rng = random.Random(seed)
    items = [(rng.randint(1, 100), rng.uniform(0.0, 10.0)) for _ in range(rng.randint(1, 8))]
    need = rng.randint(0, sum(size for size, _ in items) + 20)
    best = min(
        (
            sum(ms for _, ms in subset)
            for r in range(len(items) + 1)
            for subset in itertools.combinations(items, r)
            if sum(size for size, _ in subset) >= need
        ),
        default=None,
    )
    got = bound.least_ms(items, need)
    if best is None:
        assert got is None
        return
    assert got is not None
    assert got <= best + 1e-9  # a lower bound on every plan that drops whole storages
    assert got >= best - max(ms for _, ms in items) - 1e-9  # only the last item is taken in part


def _op(index: int, name: str, ms: float, saved: int = 0, reads: tuple[int, ...] = (), base: int | None = None) -> Any:
    from remat.profile.ops import OpRecord

    own = index if base is None else base
    return OpRecord(
        index,
        f"{name}#{index}",
        name,
        ms,
        0 if base is not None else 8,
        saved,
        reads,
        (own,),
        (),
        False,
        base is not None,
    )


def test_a_storage_costs_the_ops_between_it_and_what_was_saved_shared_among_those_that_need_them(
    bound: ModuleType,
) -> None:
    from remat.profile.ops import BlockOps

    # layer_norm (saved) -> addmm (nothing saves it) -> view -> add (saved) and mul (saved) both read the view
    ops = (
        _op(0, "native_layer_norm", 1.0, saved=10),
        _op(1, "addmm", 4.0, reads=(0,)),
        _op(2, "view", 0.25, reads=(1,), base=1),
        _op(3, "add", 0.5, saved=20, reads=(2,)),
        _op(4, "mul", 0.75, saved=30, reads=(2, 0)),
    )
    prof = SimpleNamespace(block_ops=(BlockOps(0, "b", ops, 60, 0, 5),))
    assert bound.candidates(prof, loose=True) == [(10, 1.0), (20, 0.5), (30, 0.75)]
    # addmm and its view are needed by both add and mul: half of their 4.25 ms each
    assert bound.candidates(prof) == [(10, 1.0), (20, 0.5 + 4.25 / 2), (30, 0.75 + 4.25 / 2)]


def test_the_charges_of_any_set_of_storages_add_up_to_at_most_the_ops_they_need(bound: ModuleType) -> None:
    import remat

    peers = load("peers")
    w = peers.build("A", small=True)
    prof = remat.profile(w.model, w.inputs, w.loss_fn, progress=False, repeats=1)
    wanted = bound.needs_per_storage(prof)
    charged = bound.candidates(prof)
    assert len(wanted) == len(charged) >= 8
    # an addmm feeding only a residual add is charged to the add's storage: the tight bound is not the loose one
    assert sum(ms for _, ms in charged) > sum(ms for _, ms in bound.candidates(prof, loose=True))
    rng = random.Random(0)
    for _ in range(300):
        chosen = [k for k in range(len(wanted)) if rng.random() < 0.5]
        union = set().union(*(wanted[k][1] for k in chosen)) if chosen else set()
        runs = sum(prof.block_ops[b].ops[j].ms for b, j in union)
        assert sum(charged[k][1] for k in chosen) <= runs + 1e-9
