"""benchmarks/bound.py: the fractional knapsack against brute force over every subset."""

from __future__ import annotations

import itertools
import random
from types import ModuleType

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
