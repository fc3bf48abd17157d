"""Block inputs the plain step frees later in the forward (T5's position bias): a checkpoint over blocks that
take one holds it to its backward (Profile.late_inputs, Chain.late_inputs, NOTE [ Chain cost model ])."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Op, Recompute
from remat.plan.chain import Chain
from remat.plan.planner import plan_from_ops
from remat.plan.solver import all_plans, min_peak, min_peak_plan, simulate, solve
from remat.profile import Profile

# ------------------------------------------------------------------------------------------------
# Measured: a T5-like model, two stacks whose first layer makes a position bias every later layer takes
# ------------------------------------------------------------------------------------------------


class _BiasLayer(nn.Module):
    def __init__(self, d: int, t: int, first: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.table = nn.Embedding(2 * t - 1, 1) if first else None
        self.t = t

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if bias is None:
            assert self.table is not None
            pos = torch.arange(self.t)
            bias = self.table(pos[None, :] - pos[:, None] + self.t - 1).squeeze(-1)
        h = self.fc(x)
        # The bias is only added to the scores: no op saves it, the plain step frees it when its stack returns.
        return x + ((h @ h.transpose(-1, -2)) + bias).softmax(-1) @ h, bias


class _TwoStacks(nn.Module):
    def __init__(self, d: int = 16, t: int = 96, n: int = 4) -> None:
        super().__init__()
        self.enc = nn.ModuleList(_BiasLayer(d, t, i == 0) for i in range(n))
        self.dec = nn.ModuleList(_BiasLayer(d, t, i == 0) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None
        for layer in self.enc:
            x, bias = layer(x, bias)
        bias = None  # the encoder's bias dies here (a gap), the decoder's when the model returns (the head)
        for layer in self.dec:
            x, bias = layer(x, bias)
        return x


def _plan(segments: tuple[tuple[int, int], ...], n: int = 8) -> tuple[Op, ...]:
    ops: list[Op] = []
    i = 0
    for a, b in segments:
        ops += [Keep(j) for j in range(i, a)]
        ops.append(Recompute(a, b, tuple(Keep(j) for j in range(a, b))))
        i = b
    return (*ops, *(Keep(j) for j in range(i, n)))


@pytest.fixture(scope="module")
def two_stacks() -> tuple[_TwoStacks, torch.Tensor, Profile]:
    torch.manual_seed(0)
    model, x = _TwoStacks(), torch.randn(96, 16)
    blocks = remat.blocks(model, include=["enc.*", "dec.*"])
    return model, x, remat.profile(model, x, lambda y: y.pow(2).mean(), repeats=1, blocks=blocks)


def test_the_profile_finds_the_biases_and_where_the_plain_step_frees_them(two_stacks) -> None:
    _, _, prof = two_stacks
    bias = 96 * 96 * 4
    got = {(li.nbytes, li.producer, li.freed_after, tuple(li.users)) for li in prof.late_inputs}
    assert got == {(bias, 0, 3, (1, 2, 3)), (bias, 4, 8, (5, 6, 7))}
    assert Profile.from_json(prof.to_json()).late_inputs == prof.late_inputs


@pytest.mark.parametrize(
    "segments",
    [
        ((1, 3),),  # the encoder's bias, freed in the gap after block 3, after the segment
        ((2, 4),),  # freed in the gap after the segment's last block
        ((1, 2), (2, 3)),  # two checkpoints hold one bias
        ((1, 2), (2, 4)),
        ((5, 8),),  # the decoder's bias, freed in the head; the last block passes it through
        ((5, 7),),
        ((6, 7),),
        ((1, 3), (5, 8)),
    ],
    ids=str,
)
def test_segments_that_hold_a_bias_are_predicted(two_stacks, segments: tuple[tuple[int, int], ...]) -> None:
    model, x, prof = two_stacks
    plan = plan_from_ops(prof, _plan(segments), "by hand")
    remat.apply(model, plan)
    try:
        measured = remat.measure(model, x, lambda y: y.pow(2).mean(), steps=1).peak_bytes
    finally:
        remat.remove(model)
    # Within 1.5%: two checkpoints in a row share one RNG state (about 5 KiB) that the chain counts twice.
    assert 0.985 * plan.predicted_peak_bytes <= measured <= plan.predicted_peak_bytes


def test_plans_stay_within_their_budgets(two_stacks) -> None:
    model, x, prof = two_stacks
    try:
        remat.plan(prof, budget="1B")
    except remat.BudgetInfeasibleError as e:
        floor = e.min_peak_bytes
    for budget in (floor, "60%", "70%", "80%"):
        plan = remat.plan(prof, budget=budget)
        remat.apply(model, plan)
        try:
            measured = remat.measure(model, x, lambda y: y.pow(2).mean(), steps=1).peak_bytes
        finally:
            remat.remove(model)
        # The plan depends on measured times; some op-level plans measure 0.6% above their prediction
        # (1.068 before late inputs were counted).
        assert plan.predicted_peak_bytes <= plan.budget_bytes, (budget, plan.describe())
        assert measured <= 1.01 * plan.predicted_peak_bytes, (budget, plan.describe(), measured)


# ------------------------------------------------------------------------------------------------
# The chain: simulator by hand, solvers on the safe side of it
# ------------------------------------------------------------------------------------------------


def _flat(n: int, late: tuple[tuple[int, int, int, tuple[int, ...]], ...] = ()) -> Chain:
    return Chain(
        fwd_ms=(1.0,) * (n + 1),
        bwd_ms=(1.0,) * (n + 1),
        x_bytes=(10,) * (n + 1),
        keep_bytes=(20,) * n + (0,),
        fwd_peak_bytes=(30,) * (n + 1),
        bwd_peak_bytes=(30,) * (n + 1),
        late_inputs=late,
    )


def test_a_segment_holds_a_late_input_from_its_end() -> None:
    # 100 bytes made by block 0, taken by blocks 1 and 2, freed after block 3's forward.
    chain = _flat(5, ((100, 0, 3, (1, 2)),))
    plain = _flat(5)
    assert chain.segment_bytes(1, 2) == plain.segment_bytes(1, 2) + 100  # freed after the segment
    assert chain.segment_bytes(1, 3) == plain.segment_bytes(1, 3) + 100
    assert chain.segment_bytes(3, 5) == plain.segment_bytes(3, 5)  # not an input of blocks 3..4
    assert chain.segment_bytes(0, 2) == plain.segment_bytes(0, 2)  # made inside the segment
    assert chain.segment_bytes(1, 4) == plain.segment_bytes(1, 4)  # freed in its last block's gap:
    assert chain.replay_hold_bytes(1, 4) == plain.replay_hold_bytes(1, 4) + 100  # held through its replay
    # Two checkpoints over blocks that take it hold one tensor: simulated once.
    one = simulate(chain, _plan(((1, 2),), 5)).peak_bytes - simulate(plain, _plan(((1, 2),), 5)).peak_bytes
    two = (
        simulate(chain, _plan(((1, 2), (2, 3)), 5)).peak_bytes - simulate(plain, _plan(((1, 2), (2, 3)), 5)).peak_bytes
    )
    assert one == two == 100


def _random_late(rng: np.random.Generator, n: int, hi: int) -> tuple[tuple[int, int, int, tuple[int, ...]], ...]:
    out = []
    for _ in range(int(rng.integers(1, 3))):
        producer = int(rng.integers(-1, n - 1))
        users = sorted({int(u) for u in rng.integers(producer + 1, n, int(rng.integers(1, 4)))})
        freed_after = int(rng.integers(users[-1], n + 1))
        out.append((int(rng.integers(1, hi)), producer, freed_after, tuple(users)))
    return tuple(out)


@pytest.mark.parametrize(("seed", "n"), [(seed, n) for seed in range(10) for n in (2, 3, 4, 5)])
def test_solvers_stay_on_the_safe_side_of_the_simulator(seed: int, n: int) -> None:
    # The tables charge every checkpoint over a late input's takers, the simulator each tensor once:
    # the solvers' plans fit when simulated, and their lowest peak is never below the simulator's.
    from tests.plan.test_solver import budgets, chain_peak, random_chain

    rng = np.random.default_rng(seed)
    hi = int(rng.choice([20, 60]))
    chain = dataclasses.replace(random_chain(rng, n, hi=hi), late_inputs=_random_late(rng, n, hi))
    peaks = [chain_peak(chain, ops) for ops in all_plans(n)]
    best = min_peak_plan(chain)
    assert min(peaks) <= chain_peak(chain, best) <= min_peak(chain) - chain.base_bytes
    for headroom in budgets(peaks):
        ops = solve(chain, headroom)
        if ops is not None:
            assert chain_peak(chain, ops) <= headroom
