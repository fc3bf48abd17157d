"""A few seeds of ``benchmarks/fuzz.py``, the random-model fuzzer: random chains of blocks (attention,
convolutions, BatchNorm, in-place activations, dropout, skips, keyword arguments, auxiliary outputs)
under plans at several budgets, ``full()`` and ``sqrt()``, whole and split blocks. Each cell compares
every gradient and buffer with the plain step (``torch.equal``), the measured peak with the budget, and
the model after ``remove`` with the one before ``apply``."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load

fuzz = load("fuzz")

# What must never happen; "bug:prediction" (a strategy's peak outside +-5% of its prediction, no
# budget involved) is reported by the fuzzer but not failed here: full() and sqrt() are predicted on
# the safe side by up to 15% on small random models (one RNG state charged per segment).
NEVER = {
    "bug:exception",
    "bug:grad",
    "bug:buffers",
    "bug:state",
    "bug:rng",
    "bug:remove",
    "bug:over_budget",
    "bug:budget",
}


# 104, 134, 180, 213, 358 and 696 measured 1.05-1.15x their smallest budget on the code before stop 27
# (a closing SiLU(inplace=True), an auxiliary layer left to the head, a dropped branch's saved tensors);
# before stop 28, 808 and 886 up to 1.054x (a view of an output edited in place, NOTE [ A view of a
# carried output ]), 807 1.061x (an op-level policy caching a dead branch's input), 249 and 2005 1.07-1.15x
# (a tensor a segment makes that the model's code holds, NOTE [ Late inputs made inside a segment ]), 2053,
# 2058 and 2175 1.08-1.15x (the gradients pending above a replay), 366 1.17x (a nested checkpoint's own RNG
# state, NOTE [ One RNG state per segment ]), 172 and 2082 1.07-1.11x (an output the model's code keeps past its
# saving taker, Profile.code_held_inputs); the others are the first seeds of a clean run. Still over: README, Known limits.
SEEDS = (
    104,
    134,
    172,
    180,
    213,
    249,
    358,
    361,
    366,
    696,
    807,
    808,
    886,
    2005,
    2047,
    2050,
    2053,
    2058,
    2082,
    2175,
    *range(600, 612),
)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_model_is_exact_and_within_its_budgets(seed: int) -> None:
    cells = fuzz.run_seed(seed)
    bad = [f"{c['cell']}: {c['cls']}: {c['msg'][:300]}" for c in cells if c["cls"] in NEVER]
    assert not bad, "\n".join(bad)
    assert any(c["cls"] == "ok" for c in cells) or all(c["cls"] == "skip" for c in cells)
