"""A replay runs the recorded blocks, not the code between them: a transient of that code (gap_peak_bytes,
charged to the next block's forward peak) is not charged where that block is replayed (helper-73).
"""

import copy
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import remat
from remat.plan.solver import all_plans, min_peak, min_peak_plan, simulate, solve
from tests.plan.test_solver import bare, budgets, chain_peak, random_chain

D, N, WIDE, L = 64, 256, 24, 6


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class _WideGap(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer() for _ in range(L)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(self.layers):
            if k == 1:  # a wide temporary between blocks 0 and 1, freed at once
                x = x + x.repeat(1, WIDE).sum(-1, keepdim=True) * 1e-3
            x = layer(x)
        return x


def _loss(o: torch.Tensor) -> torch.Tensor:
    return (o**2).mean()


def _measure(model: nn.Module, plan: remat.Plan, x: torch.Tensor) -> tuple[int, dict]:
    m = copy.deepcopy(model)
    remat.apply(m, plan)
    peak = remat.measure(m, x, _loss, steps=1, progress=False).peak_bytes
    torch.manual_seed(1)
    _loss(m(x)).backward()
    return peak, {k: p.grad for k, p in m.named_parameters()}


def test_gap_transient_is_not_charged_to_replays() -> None:
    torch.manual_seed(0)
    model, x = _WideGap(), torch.randn(N, D)
    prof = remat.profile(model, x, _loss, repeats=1, ops=False, progress=False)
    assert prof.block_profiles[0].gap_peak_bytes > 0
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    _loss(ref(x)).backward()
    full = remat.plan(prof, strategy="full()")
    measured, grads = _measure(model, full, x)
    for k, p in ref.named_parameters():
        assert torch.equal(p.grad, grads[k])
    # An upper bound, within 5% (before the fix: predicted at 1.41x the measured peak).
    assert measured <= full.predicted_peak_bytes <= 1.05 * measured
    # A budget full() meets is planned (before: BudgetInfeasibleError), and kept.
    budget = int(measured * 1.03)
    plan = remat.plan(prof, budget=budget)
    assert plan.predicted_peak_bytes <= budget
    got, _ = _measure(model, plan, x)
    assert got <= budget * 1.05


def _with_gap_rises(chain, rng, hi):
    """The chain with a rise of the code before some blocks: their fwd_peak_bytes is max(own, rise), their
    replay_fwd_peak_bytes their own (as chain_of makes them)."""
    n = chain.n
    own = np.asarray(chain.fwd_peak_bytes)
    rise = rng.integers(0, 3 * hi, n + 1) * rng.integers(0, 2, n + 1)
    rise[0] = rise[n] = 0
    return dataclasses.replace(
        chain,
        fwd_peak_bytes=tuple(int(v) for v in np.maximum(own, rise)),
        replay_fwd_peak_bytes=tuple(int(v) for v in own),
        gap_rise_bytes=tuple(int(v) for v in rise),
    )


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "knapsack"])
@pytest.mark.parametrize("seed", range(12))
def test_solvers_match_brute_force_with_gap_rises(seed: int, nested: bool) -> None:
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(2, 6))
    hi = int(rng.choice([4, 20, 60]))
    chain = _with_gap_rises(random_chain(rng, n, hi=hi, negative_keep=seed % 3 == 2), rng, hi)
    b = bare(chain)
    plans = list(all_plans(n, nested=nested))
    figures = [
        (simulate(b, ops).peak_bytes, simulate(chain, ops).peak_bytes, simulate(b, ops).total_ms) for ops in plans
    ]
    assert min_peak(chain, nested=nested) == min(full for _, full, _ in figures)
    assert simulate(chain, min_peak_plan(chain, nested=nested)).peak_bytes == min(full for _, full, _ in figures)
    lowest = min(p for p, _, _ in figures)
    for headroom in budgets(p for p, _, _ in figures):
        ops = solve(chain, headroom, nested=nested)
        fitting = [ms for p, _, ms in figures if p <= headroom]
        if headroom < lowest:
            assert ops is None
            continue
        assert ops is not None and chain_peak(chain, ops) <= headroom
        assert simulate(chain, ops).total_ms == pytest.approx(min(fitting), rel=1e-12, abs=1e-12)


def test_replay_peaks_without_the_gap_rise() -> None:
    """One block after a wide gap, recomputed: the forward charges the rise, the replay does not."""
    from remat.core.ops import Keep, Recompute
    from remat.plan.chain import Chain

    chain = Chain(
        fwd_ms=(1.0, 1.0, 1.0),
        bwd_ms=(1.0, 1.0, 0.0),
        x_bytes=(10, 10, 10),
        keep_bytes=(20, 20, 0),
        fwd_peak_bytes=(20, 1000, 0),  # a 1000-byte transient of the code before block 1
        bwd_peak_bytes=(5, 5, 0),
        replay_fwd_peak_bytes=(20, 20, 0),
        gap_rise_bytes=(0, 1000, 0),
    )
    ops = (Keep(0), Recompute(1, 2, (Keep(1),)))
    # forward: level 20 when block 1 starts, +1000; the replay at 20 + 10 + 20 = 50 only.
    assert simulate(chain, ops).peak_bytes == 1020
    assert simulate(chain, (Keep(0), Keep(1))).peak_bytes == 1020
