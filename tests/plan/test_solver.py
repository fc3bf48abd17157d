"""Tests of remat.plan.solver: the simulator by hand, the solvers against brute force over all plans."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable

import numpy as np
import pytest

from remat.core.ops import Keep, Op, Recompute, RecomputeSub
from remat.errors import RematError
from remat.plan.chain import Chain
from remat.plan.solver import Simulation, all_plans, min_peak, min_peak_plan, simulate, solve

# ------------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------------


def hand_chain() -> Chain:
    """Two blocks and the head, numbers small enough to simulate on paper (see the tests below)."""
    return Chain(
        fwd_ms=(1.0, 2.0, 3.0),
        bwd_ms=(2.0, 4.0, 5.0),
        x_bytes=(10, 20, 30),
        keep_bytes=(40, 50, 0),
        fwd_peak_bytes=(60, 70, 8),
        bwd_peak_bytes=(15, 25, 12),
        base_bytes=10,
        pre_peak_bytes=12,
        tail_peak_bytes=3,
    )


def random_chain(rng: np.random.Generator, n: int, hi: int, *, negative_keep: bool = False) -> Chain:
    """A chain with integer sizes in [0, hi) and fwd/bwd peaks above the level rise, like a profile."""
    keep = rng.integers(0, hi, n + 1)
    if negative_keep:
        # A block whose input is freed after it (e.g. a pooling layer) lowers the level.
        keep = keep - rng.integers(0, hi // 2 + 1, n + 1)
    keep[-1] = 0
    x = rng.integers(1, hi, n + 1)
    fwd = rng.uniform(0.5, 5.0, n + 1)
    return Chain(
        fwd_ms=tuple(float(v) for v in fwd),
        bwd_ms=tuple(float(v) for v in rng.uniform(0.5, 10.0, n + 1)),
        x_bytes=tuple(int(v) for v in x),
        keep_bytes=tuple(int(v) for v in keep),
        fwd_peak_bytes=tuple(int(v) for v in np.maximum(keep, 0) + rng.integers(0, hi, n + 1)),
        bwd_peak_bytes=tuple(int(v) for v in rng.integers(0, hi, n + 1)),
        base_bytes=int(rng.integers(0, hi)),
        pre_peak_bytes=int(rng.integers(0, hi)),
        tail_peak_bytes=int(rng.integers(0, hi)),
        # Part of each output not saved by its own block (at most the next block's input).
        out_free_bytes=tuple(int(v) for v in rng.integers(0, np.append(x[1:], 1) + 1)),
        ckpt_fwd_ms=tuple(float(v) for v in fwd + rng.uniform(0.0, 2.0, n + 1)),
        ckpt_call_ms=float(rng.choice([0.0, 0.5, 3.0])),
        # The part of each forward after its last saved tensor, which a replay ending there skips.
        stop_ms=tuple(float(v) for v in fwd * rng.uniform(0.0, 1.0, n + 1) * rng.integers(0, 2, n + 1)),
        ckpt_state_bytes=int(rng.choice([0, 1, 3])),
        # An input the plain step frees right after its block (a block that does not save its input).
        freed_input_bytes=tuple(int(v) for v in rng.integers(0, hi // 2 + 1, n + 1) * rng.integers(0, 2, n + 1)),
        # Of a negative gap, what a segment ending at the block frees too (Chain.released_bytes).
        released_bytes=tuple(int(v) for v in rng.integers(0, hi // 2 + 1, n + 1) * rng.integers(0, 2, n + 1)),
        # Activation gradients pending when each block's backward starts (a segment ending there replays above them).
        pending_grad_bytes=tuple(int(v) for v in rng.integers(0, hi // 2 + 1, n + 1) * rng.integers(0, 2, n + 1))[:n]
        + (0,),
    )


def chain_peak(chain: Chain, ops: tuple[Op, ...]) -> int:
    """The simulated peak of the chain alone, above ``base_bytes`` (what ``solve``'s headroom bounds).

    ``simulate`` also counts pre_peak, base and tail; with those zeroed the peak is the chain's.
    """
    bare = dataclasses.replace(chain, base_bytes=0, pre_peak_bytes=-(10**18), tail_peak_bytes=-(10**18))
    return simulate(bare, ops).peak_bytes


def bare(chain: Chain) -> Chain:
    """The chain without base, pre-peak and tail: ``simulate`` then gives the chain's own peak."""
    return dataclasses.replace(chain, base_bytes=0, pre_peak_bytes=-(10**18), tail_peak_bytes=-(10**18))


def measured(chain: Chain, ops: tuple[Op, ...], bare_chain: Chain | None = None) -> tuple[int, int, float]:
    """(chain peak above base, ``simulate``'s peak, total ms) of a plan, from one simulation of the bare chain.

    The simulator starts at ``base_bytes``, so every level of the real chain is the bare chain's plus
    ``base_bytes``, and ``simulate`` takes the maximum with ``pre_peak_bytes`` and ``base + tail``; the
    times do not depend on those three. ``bare_chain``: ``bare(chain)``, when the caller has it.
    """
    sim = simulate(bare_chain or bare(chain), ops)
    full = max(chain.base_bytes + sim.peak_bytes, chain.pre_peak_bytes, chain.base_bytes + chain.tail_peak_bytes)
    return sim.peak_bytes, full, sim.total_ms


def brute_force(chain: Chain, nested: bool) -> list[tuple[int, float]]:
    """(chain peak above base, total ms) of every plan in the solver's plan space."""
    b = bare(chain)
    return [(peak, ms) for peak, _, ms in (measured(chain, ops, b) for ops in all_plans(chain.n, nested=nested))]


def budgets(peaks: Iterable[int], count: int = 7) -> list[int]:
    """Headrooms from one below the lowest chain peak to one above the highest, the ends included."""
    values = sorted(set(peaks))
    lo, hi = values[0], values[-1]
    picks = {lo - 1, lo, hi, hi + 1, *np.linspace(lo, hi, count).round().astype(int).tolist()}
    return sorted(picks | set(values[:: max(1, len(values) // count)]))


def depth(ops: tuple[Op, ...]) -> int:
    return max((1 + depth(op.inner) for op in ops if isinstance(op, Recompute)), default=0)


# ------------------------------------------------------------------------------------------------
# simulate by hand
# ------------------------------------------------------------------------------------------------

# Every plan of the hand chain with its simulated (peak, extra ms); time once through = 1+2+3+2+4+5 = 17 ms.
R0 = Recompute(0, 1, (Keep(0),))
R1 = Recompute(1, 2, (Keep(1),))
HAND = [
    # L=10. K0: 10+60=70, L=50. K1: 50+70=120, L=100. head: 100+8, 100+12. bwd K1: 100+25=125, L=50;
    # bwd K0: 50+15=65, L=10. Tail 10+3=13, pre 12.
    ((Keep(0), Keep(1)), 125, 0.0),
    # R0 fwd: 10+60=70, L=10+x1=30. K1: 30+70=100, L=80. head 88, 92. bwd K1: 80+25=105, L=30.
    # bwd R0: replay K0 30+60=90, L=70; bwd K0 70+15=85, L=30; L-=20 -> 10. Extra f0 = 1.
    ((R0, Keep(1)), 105, 1.0),
    # K0: 70, L=50. R1 fwd: 50+70=120, L=50+x2=80. head 88, 92. bwd R1: replay K1 80+70=150, L=130;
    # bwd K1 130+25=155, L=80; L=50. bwd K0 65. Extra f1 = 2.
    ((Keep(0), R1), 155, 2.0),
    # R0 fwd 70, L=30. R1 fwd: 30+70=100, L=60. head 68, 72. bwd R1: replay K1 60+70=130, L=110; bwd 135;
    # L=30. bwd R0: replay 90, bwd 85. Extra 1 + 2 = 3.
    ((R0, R1), 135, 3.0),
    # R[0:2] fwd: q=0 10+60=70, q=1 10+70+x1=100; L=10+x2=40. head 48, 52. bwd: replay K0 40+60=100,
    # L=80; K1 80+70=150, L=130; bwd K1 155, L=80; bwd K0 95, L=40; L=10. Extra 1 + 2 = 3.
    ((Recompute(0, 2, (Keep(0), Keep(1))),), 155, 3.0),
    # As above, but the replay checkpoints block 0: replay R0 40+60=100, L=60; K1 60+70=130, L=110;
    # bwd K1 135, L=60; bwd R0: replay K0 120, L=100, bwd 115. Extra 3 + 1 = 4.
    ((Recompute(0, 2, (R0, Keep(1))),), 135, 4.0),
]


@pytest.mark.parametrize(("ops", "peak", "extra"), HAND)
def test_simulate_by_hand(ops: tuple[Op, ...], peak: int, extra: float) -> None:
    assert simulate(hand_chain(), ops) == Simulation(peak_bytes=peak, total_ms=17.0 + extra, extra_ms=extra)


def test_hand_plans_are_the_whole_plan_space() -> None:
    assert sorted(map(repr, all_plans(2))) == sorted(repr(ops) for ops, _, _ in HAND)


def test_simulate_counts_pre_peak_and_tail() -> None:
    chain = hand_chain()
    high_pre = dataclasses.replace(chain, pre_peak_bytes=500)
    high_tail = dataclasses.replace(chain, tail_peak_bytes=400)
    plan = (Keep(0), Keep(1))
    assert simulate(high_pre, plan).peak_bytes == 500
    assert simulate(high_tail, plan).peak_bytes == 410  # base 10 + tail 400


def test_simulate_recompute_sub() -> None:
    # Block 0 saves 30 bytes by checkpointing its attention: S' = 40-30 = 10, fp' = 60 (its forward
    # still makes the attention's tensors), bp' = 15+30 = 45 (they are recomputed in its backward, above
    # the lower level). L=10: fwd 10+60=70, L=20. K1: 20+70=90, L=70. head 78, 82.
    # bwd K1 70+25=95, L=20. bwd S0 20+45=65, L=10. Peak 95; extra 0.5 ms of recomputed attention.
    plan = (RecomputeSub(0, ("attn",)), Keep(1))
    got = simulate(hand_chain(), plan, sub_costs={(0, ("attn",)): (30, 0.5)})
    assert got == Simulation(peak_bytes=95, total_ms=17.5, extra_ms=0.5)


def test_simulate_recompute_sub_needs_costs() -> None:
    plan = (RecomputeSub(0, ("attn",)), Keep(1))
    with pytest.raises(RematError, match=r"no costs for S0\{attn\}; pass sub_costs"):
        simulate(hand_chain(), plan)
    with pytest.raises(RematError, match=r"no costs for S0\{attn\}"):
        simulate(hand_chain(), plan, sub_costs={(0, ("mlp",)): (1, 1.0)})


@pytest.mark.parametrize(
    ("ops", "match"),
    [
        ((Keep(1), Keep(0)), r"operation K1 at position 0 is for block 1, expected block 0"),
        ((Keep(0),), r"cover blocks 0\.\.0 but must cover 0\.\.1"),
        ((Keep(0), Keep(0), Keep(1)), r"operation K0 at position 1 is for block 0, expected block 1"),
        ((Keep(0), Keep(1), Keep(2)), r"operation K2 at position 2 is past block 1"),
        ((Recompute(0, 3, (Keep(0), Keep(1), Keep(2))),), r"R\[0:3\]\(K0 K1 K2\) at position 0 spans blocks 0\.\.2"),
        ((Recompute(0, 0, ()), Keep(0), Keep(1)), r"R\[0:0\]\(\) at position 0 spans blocks 0\.\.-1"),
        ((Recompute(0, 2, (Keep(0),)),), r"inner plan of R\[0:2\]\(K0\): operations cover blocks 0\.\.0 but must"),
        ((Recompute(0, 2, (Keep(1), Keep(0))),), r"inner plan of R\[0:2\]\(K1 K0\): operation K1 at position 0"),
        ((Recompute(0, 2, (Keep(0), R1)),), r"ends its inner plan with R\[1:2\]\(K1\).*must end with Keep\(1\)"),
        (("K0", Keep(1)), r"operation 'K0' at position 0 is a str; expected Keep, Recompute"),
    ],
)
def test_simulate_rejects_bad_plans(ops: tuple[Op, ...], match: str) -> None:
    with pytest.raises(RematError, match=match):
        simulate(hand_chain(), ops)


# ------------------------------------------------------------------------------------------------
# solve and min_peak on the hand chain
# ------------------------------------------------------------------------------------------------


def test_solve_by_hand() -> None:
    chain = hand_chain()
    # Chain peaks above base 10 (from HAND): keep-all 115 at 17 ms; (R0 K1) 95 at 18 ms, the lowest.
    assert solve(chain, 115) == (Keep(0), Keep(1))
    assert solve(chain, 114) == (R0, Keep(1))
    assert solve(chain, 95) == (R0, Keep(1))
    assert solve(chain, 94) is None
    assert min_peak(chain) == 105
    assert min_peak_plan(chain) == (R0, Keep(1))


def test_solve_prefers_keep_on_ties() -> None:
    # Free forwards: every plan takes the same time, so the tie-break (keep first) decides.
    chain = Chain(
        fwd_ms=(0.0,) * 4,
        bwd_ms=(1.0,) * 4,
        x_bytes=(1,) * 4,
        keep_bytes=(5, 5, 5, 0),
        fwd_peak_bytes=(6, 6, 6, 0),
        bwd_peak_bytes=(1, 1, 1, 0),
    )
    assert solve(chain, 10**6) == (Keep(0), Keep(1), Keep(2))
    assert solve(chain, 10**6, nested=False) == (Keep(0), Keep(1), Keep(2))


def test_solve_rejects_bad_slots() -> None:
    with pytest.raises(RematError, match=r"slots=0 must be at least 1"):
        solve(hand_chain(), 100, slots=0)


def test_solve_negative_headroom_has_no_plan() -> None:
    assert solve(hand_chain(), -1) is None


# ------------------------------------------------------------------------------------------------
# The plan space
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(0, 7))
def test_all_plans_counts_and_validity(n: int) -> None:
    nested = list(all_plans(n))
    knapsack = list(all_plans(n, nested=False))
    # Nested plans of n blocks are counted by the large Schroeder numbers; single-level plans by 2**n.
    assert len(nested) == [1, 2, 6, 22, 90, 394, 1806][n]
    assert len(knapsack) == 2**n
    assert len(set(map(repr, nested))) == len(nested)
    assert {repr(p) for p in knapsack} <= {repr(p) for p in nested}
    chain = Chain((1.0,) * (n + 1), (1.0,) * (n + 1), (1,) * (n + 1), (1,) * (n + 1), (1,) * (n + 1), (1,) * (n + 1))
    for ops in nested:
        simulate(chain, ops)  # raises on a malformed plan
    for ops in knapsack:
        for op in ops:
            assert isinstance(op, Keep) or (
                isinstance(op, Recompute) and op == Recompute(op.start, op.start + 1, (Keep(op.start),))
            )


# ------------------------------------------------------------------------------------------------
# Oracle: the solvers against brute force over all plans (1-byte units, so the program is exact)
# ------------------------------------------------------------------------------------------------

ORACLE_CASES = (
    [(seed, n) for seed in range(12) for n in (1, 2, 3, 4, 5, 6)]
    + [(100 + seed, 7) for seed in range(3)]
    + [(200 + seed, 8) for seed in range(2)]
)


@functools.cache
def oracle(
    seed: int, n: int, nested: bool
) -> tuple[Chain, tuple[tuple[Op, ...], ...], tuple[tuple[int, int, float], ...]]:
    """The random chain of an oracle case, every plan of the space and its ``measured`` figures.

    Cached: the solve and min_peak oracles below read the same brute force (on 8 blocks, 48639
    nested plans), so each case simulates every plan once for both.
    """
    rng = np.random.default_rng(seed)
    chain = random_chain(rng, n, hi=int(rng.choice([4, 20, 60])), negative_keep=seed % 3 == 2)
    plans = tuple(all_plans(n, nested=nested))
    b = bare(chain)
    return chain, plans, tuple(measured(chain, ops, b) for ops in plans)


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "knapsack"])
@pytest.mark.parametrize(("seed", "n"), ORACLE_CASES)
def test_solve_matches_brute_force(seed: int, n: int, nested: bool) -> None:
    chain, _, figures = oracle(seed, n, nested)
    plans = [(peak, ms) for peak, _, ms in figures]
    lowest = min(peak for peak, _ in plans)
    previous = math.inf
    for headroom in budgets(peak for peak, _ in plans):
        ops = solve(chain, headroom, nested=nested)
        fitting = [ms for peak, ms in plans if peak <= headroom]
        if headroom < lowest:
            assert ops is None and not fitting
            continue
        assert ops is not None, f"headroom {headroom} >= lowest chain peak {lowest} but solve found no plan"
        assert chain_peak(chain, ops) <= headroom
        got = simulate(chain, ops).total_ms
        assert got == pytest.approx(min(fitting), rel=1e-12, abs=1e-12)
        assert got <= previous + 1e-12  # more memory never costs time
        previous = got


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "knapsack"])
@pytest.mark.parametrize(("seed", "n"), ORACLE_CASES)
def test_min_peak_matches_brute_force(seed: int, n: int, nested: bool) -> None:
    chain, _, figures = oracle(seed, n, nested)
    full_peaks = [full for _, full, _ in figures]
    assert min_peak(chain, nested=nested) == min(full_peaks)
    best = min_peak_plan(chain, nested=nested)
    assert simulate(chain, best).peak_bytes == min(full_peaks)
    if not nested:
        assert depth(best) <= 1
    # solve finds a plan exactly from the lowest chain peak on.
    lowest = min(peak for peak, _, _ in figures)
    assert solve(chain, lowest, nested=nested) is not None
    assert solve(chain, lowest - 1, nested=nested) is None


def test_nesting_never_loses_to_knapsack() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        chain = random_chain(rng, int(rng.integers(2, 12)), hi=50)
        lo = min_peak(chain, nested=False) - chain.base_bytes
        for headroom in (lo, lo + 25, lo + 100):
            flat, deep = solve(chain, headroom, nested=False), solve(chain, headroom)
            assert flat is not None and deep is not None
            assert simulate(chain, deep).total_ms <= simulate(chain, flat).total_ms + 1e-9


# ------------------------------------------------------------------------------------------------
# Coarse units: never over the budget, and the program's value is the simulated time
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [1, 3, 10, 57, None])
def test_coarse_units_stay_within_budget(slots: int | None) -> None:
    rng = np.random.default_rng(1234 + (slots or 0))
    for _ in range(25):
        n = int(rng.integers(1, 30))
        chain = random_chain(rng, n, hi=int(rng.choice([10**4, 10**7, 10**9])), negative_keep=bool(rng.integers(2)))
        keep_all = chain_peak(chain, tuple(Keep(k) for k in range(n)))
        lowest = min_peak(chain) - chain.base_bytes
        for headroom in np.linspace(lowest, keep_all * 1.1, 6).astype(np.int64).tolist():
            ops = solve(chain, headroom, slots=slots)
            if ops is not None:
                assert chain_peak(chain, ops) <= headroom
            if slots is None and headroom >= keep_all * 1.1 - 1 and headroom > 0:
                assert ops is not None  # fine units cost at most a few percent of the headroom


def test_coarse_units_lose_nothing_to_a_run_of_kept_blocks() -> None:
    # 50 blocks of 101 bytes each: keeping all peaks at 50 * 101 = 5050 bytes. In 100-byte units
    # (5250 bytes / 53 slots) rounding each block up to 2 units would need 100 of the 52 units;
    # counted along the run, the chain needs ceil(5050 / 100) = 51.
    n = 50
    chain = Chain(
        fwd_ms=(1.0,) * (n + 1),
        bwd_ms=(1.0,) * (n + 1),
        x_bytes=(1,) * (n + 1),
        keep_bytes=(101,) * n + (0,),
        fwd_peak_bytes=(101,) * n + (0,),
        bwd_peak_bytes=(0,) * (n + 1),
    )
    assert chain_peak(chain, tuple(Keep(k) for k in range(n))) == 5050
    assert solve(chain, 5250, slots=53) == tuple(Keep(k) for k in range(n))


@pytest.mark.parametrize("slots", [4, 33])
def test_coarse_units_never_beat_the_optimum(slots: int) -> None:
    rng = np.random.default_rng(99 + slots)
    for _ in range(8):
        chain = random_chain(rng, int(rng.integers(1, 6)), hi=10**8)
        plans = brute_force(chain, nested=True)
        for headroom in budgets((peak for peak, _ in plans), count=5):
            ops = solve(chain, headroom, slots=slots)
            if ops is None:
                continue
            assert chain_peak(chain, ops) <= headroom
            best = min(ms for peak, ms in plans if peak <= headroom)
            assert simulate(chain, ops).total_ms >= best - 1e-9


def test_program_value_is_the_simulated_time() -> None:
    # White-box: the table's value at the top must be the simulated time of the rebuilt plan.
    from remat.plan import solver

    rng = np.random.default_rng(5)
    for nested in (True, False):
        for _ in range(10):
            n = int(rng.integers(1, 40))
            chain = random_chain(rng, n, hi=10**6)
            headroom = (min_peak(chain) - chain.base_bytes) * 3 // 2
            table = solver._fill(
                chain,
                unit_bytes=max(1, -(-headroom // 100)),
                top_units=100,
                nested=nested,
                variants=solver._variants(chain, None),
            )
            value = table.opt[0, n, 100]
            if math.isfinite(value):
                ops = solver._rebuild(table, 0, n, 100)
                assert simulate(chain, ops).total_ms == pytest.approx(value, rel=1e-12)


def test_solve_two_hundred_blocks_fits() -> None:
    rng = np.random.default_rng(3)
    chain = random_chain(rng, 200, hi=10**8)
    keep_all = chain_peak(chain, tuple(Keep(k) for k in range(200)))
    lowest = min_peak(chain) - chain.base_bytes
    ops = solve(chain, (keep_all + lowest) // 2)
    assert ops is not None
    assert chain_peak(chain, ops) <= (keep_all + lowest) // 2
    assert simulate(chain, ops).extra_ms > 0


# ------------------------------------------------------------------------------------------------
# Keep variants (NOTE [ Keep variants ]): blocks kept with a sub-module checkpointed inside them
# ------------------------------------------------------------------------------------------------


def random_subs(rng: np.random.Generator, chain: Chain) -> dict[tuple[int, tuple[str, ...]], tuple[int, float]]:
    """One or two sub-module groups on some blocks, each freeing part of the block's keep_bytes."""
    subs: dict[tuple[int, tuple[str, ...]], tuple[int, float]] = {}
    for k in range(chain.n):
        for name in ("attn", "mlp")[: int(rng.integers(0, 3))]:
            saved = int(rng.integers(0, max(1, chain.keep_bytes[k]) + 1))
            subs[(k, (f"{k}.{name}",))] = (saved, float(rng.uniform(0.1, 3.0)))
    return subs


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "knapsack"])
@pytest.mark.parametrize("seed", range(10))
def test_solve_with_keep_variants_matches_brute_force(seed: int, nested: bool) -> None:
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(1, 6))
    chain = random_chain(rng, n, hi=int(rng.choice([8, 40])))
    subs = random_subs(rng, chain)
    groups: dict[int, list[tuple[str, ...]]] = {}
    for k, fqns in subs:
        groups.setdefault(k, []).append(fqns)
    plans = [
        (chain_peak_subs(chain, ops, subs), simulate(chain, ops, subs).total_ms)
        for ops in all_plans(n, nested=nested, subs=groups)
    ]
    lowest = min(p for p, _ in plans)
    assert (
        min_peak(chain, nested=nested, sub_costs=subs)
        == simulate(chain, min_peak_plan(chain, nested=nested, sub_costs=subs), subs).peak_bytes
    )
    for headroom in budgets(p for p, _ in plans):
        ops = solve(chain, headroom, nested=nested, sub_costs=subs)
        fitting = [ms for p, ms in plans if p <= headroom]
        if headroom < lowest:
            assert ops is None and not fitting
            continue
        assert ops is not None
        assert chain_peak_subs(chain, ops, subs) <= headroom
        assert simulate(chain, ops, subs).total_ms == pytest.approx(min(fitting), rel=1e-12, abs=1e-12)


def chain_peak_subs(
    chain: Chain, ops: tuple[Op, ...], subs: dict[tuple[int, tuple[str, ...]], tuple[int, float]]
) -> int:
    zeroed = dataclasses.replace(chain, base_bytes=0, pre_peak_bytes=0, tail_peak_bytes=0)
    return simulate(zeroed, ops, subs).peak_bytes


def test_keep_variants_can_beat_whole_block_plans() -> None:
    # Block 0 (S 100, fp 100, bp 20) can checkpoint its attention, freeing 80 bytes for 1 ms; block 1
    # (S 50, fp 50, bp 10) runs on top of what block 0 holds. Keep-all peaks at 100+50+10 = 160.
    # Recompute block 0: fwd 100, L=10; K1 60, L=60; bwd 70, L=10; recompute 110, bwd 130 (+10 ms).
    # Variant S0: S' = 20, fp' = 100, bp' = 20 + 80; fwd 100, L=20; K1 70, L=70; bwd 80, L=20; bwd S0
    # 20+100 = 120 (+1 ms). So between 120 and 130 only the variant fits, and at 130 it is faster.
    chain = Chain(
        fwd_ms=(10.0, 5.0, 0.0),
        bwd_ms=(10.0, 5.0, 0.0),
        x_bytes=(10, 10, 10),
        keep_bytes=(100, 50, 0),
        fwd_peak_bytes=(100, 50, 0),
        bwd_peak_bytes=(20, 10, 0),
    )
    subs = {(0, ("0.attn",)): (80, 1.0)}
    variant = (RecomputeSub(0, ("0.attn",)), Keep(1))
    assert simulate(chain, variant, subs) == Simulation(peak_bytes=120, total_ms=31.0, extra_ms=1.0)
    assert solve(chain, 125) is None
    assert solve(chain, 125, sub_costs=subs) == variant
    assert solve(chain, 130) == (Recompute(0, 1, (Keep(0),)), Keep(1))
    assert solve(chain, 130, sub_costs=subs) == variant
    assert solve(chain, 160, sub_costs=subs) == (Keep(0), Keep(1))  # when keeping fits, nothing is recomputed
    assert min_peak(chain) == 130 and min_peak(chain, sub_costs=subs) == 120


# ------------------------------------------------------------------------------------------------
# Parameter gradients allocated in the backward (NOTE [ Gradients in the program ])
# ------------------------------------------------------------------------------------------------


def test_simulate_gradients_by_hand() -> None:
    chain = dataclasses.replace(hand_chain(), grad_bytes=(5, 7, 3))
    # Keep all. L=10. K0: 70, L=50. K1: 120, L=100. head 108, 112; its gradients stay: L=103.
    # bwd K1: 103+25=128, L=103-50+7=60. bwd K0: 60+15=75, L=60-40+5=25. Tail 13, pre 12.
    assert simulate(chain, (Keep(0), Keep(1))).peak_bytes == 128
    # R0 fwd 70, L=30. K1: 100, L=80. head 88, 92, L=83. bwd K1: 108, L=83-50+7=40.
    # bwd R0: the replay runs above block 1's and the head's gradients: K0 40+60=100, L=80;
    # bwd K0 80+15=95, L=80-40+5=45; L-=20 -> 25.
    assert simulate(chain, (R0, Keep(1))).peak_bytes == 108
    # Without gradients (held) the same plans peak at 125 and 105 (HAND).
    assert simulate(hand_chain(), (R0, Keep(1))).peak_bytes == 105


def with_grads(rng: np.random.Generator, chain: Chain, hi: int) -> Chain:
    """``chain`` with random gradient bytes per block and for the head (some zero, like frozen blocks)."""
    grads = rng.integers(0, hi, chain.n + 1) * rng.integers(0, 2, chain.n + 1)
    return dataclasses.replace(chain, grad_bytes=tuple(int(v) for v in grads))


# As ORACLE_CASES, without the 8-block chains (seconds each).
GRADIENT_CASES = [(seed, n) for seed in range(12) for n in (1, 2, 3, 4, 5, 6)] + [(100, 7), (101, 7)]


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "knapsack"])
@pytest.mark.parametrize(("seed", "n"), GRADIENT_CASES)
def test_solve_with_gradients_matches_brute_force(seed: int, n: int, nested: bool) -> None:
    rng = np.random.default_rng(5000 + seed)
    hi = int(rng.choice([4, 20, 60]))
    chain = with_grads(rng, random_chain(rng, n, hi=hi, negative_keep=seed % 3 == 2), hi)
    plans = brute_force(chain, nested)
    lowest = min(peak for peak, _ in plans)
    assert min_peak(chain, nested=nested) == min(simulate(chain, ops).peak_bytes for ops in all_plans(n, nested=nested))
    assert simulate(chain, min_peak_plan(chain, nested=nested)).peak_bytes == min_peak(chain, nested=nested)
    for headroom in budgets(peak for peak, _ in plans):
        ops = solve(chain, headroom, nested=nested)
        fitting = [ms for peak, ms in plans if peak <= headroom]
        if headroom < lowest:
            assert ops is None and not fitting
            continue
        assert ops is not None, f"headroom {headroom} >= lowest chain peak {lowest} but solve found no plan"
        assert chain_peak(chain, ops) <= headroom
        assert simulate(chain, ops).total_ms == pytest.approx(min(fitting), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_solve_with_gradients_and_keep_variants_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(6000 + seed)
    n = int(rng.integers(1, 6))
    chain = with_grads(rng, random_chain(rng, n, hi=40), 40)
    subs = random_subs(rng, chain)
    groups: dict[int, list[tuple[str, ...]]] = {}
    for k, fqns in subs:
        groups.setdefault(k, []).append(fqns)
    sims = [(chain_peak_subs(chain, ops, subs), simulate(chain, ops, subs)) for ops in all_plans(n, subs=groups)]
    plans = [(p, sim.total_ms) for p, sim in sims]
    assert min_peak(chain, sub_costs=subs) == min(sim.peak_bytes for _, sim in sims)
    for headroom in budgets(p for p, _ in plans):
        ops = solve(chain, headroom, sub_costs=subs)
        fitting = [ms for p, ms in plans if p <= headroom]
        if not fitting:
            assert ops is None
            continue
        assert ops is not None and chain_peak_subs(chain, ops, subs) <= headroom
        assert simulate(chain, ops, subs).total_ms == pytest.approx(min(fitting), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("slots", [3, 57, None])
def test_coarse_units_with_gradients_stay_within_budget(slots: int | None) -> None:
    rng = np.random.default_rng(777 + (slots or 0))
    for _ in range(15):
        n = int(rng.integers(1, 30))
        hi = int(rng.choice([10**4, 10**7]))
        chain = with_grads(rng, random_chain(rng, n, hi=hi, negative_keep=bool(rng.integers(2))), hi)
        keep_all = chain_peak(chain, tuple(Keep(k) for k in range(n)))
        lowest = min_peak(chain) - chain.base_bytes
        for headroom in np.linspace(lowest, keep_all * 1.1, 5).astype(np.int64).tolist():
            ops = solve(chain, headroom, slots=slots)
            if ops is not None:
                assert chain_peak(chain, ops) <= headroom
            if slots is None and headroom >= keep_all * 1.1 - 1 and headroom > 0:
                assert ops is not None


def test_program_value_with_gradients_is_the_simulated_time() -> None:
    from remat.plan import solver

    rng = np.random.default_rng(8)
    for nested in (True, False):
        for _ in range(8):
            n = int(rng.integers(1, 30))
            chain = with_grads(rng, random_chain(rng, n, hi=10**6), 10**6)
            headroom = (min_peak(chain) - chain.base_bytes) * 3 // 2
            table = solver._fill(
                chain,
                unit_bytes=max(1, -(-headroom // 100)),
                top_units=100,
                nested=nested,
                variants=solver._variants(chain, None),
            )
            value = table.opt[0, n, 100]
            if math.isfinite(value):
                ops = solver._rebuild(table, 0, n, 100)
                assert simulate(chain, ops).total_ms == pytest.approx(value, rel=1e-12)
                assert chain_peak(chain, ops) <= headroom


# ------------------------------------------------------------------------------------------------
# Barriers: segments of several blocks only across joinable boundaries (Chain.joinable)
# ------------------------------------------------------------------------------------------------


def _crosses(ops: tuple[Op, ...], joinable: tuple[bool, ...]) -> bool:
    for op in ops:
        if isinstance(op, Recompute):
            if not all(joinable[op.start : op.stop - 1]) or _crosses(op.inner, joinable):
                return True
    return False


@pytest.mark.parametrize(("seed", "n"), [(300 + seed, n) for seed in range(4) for n in (3, 4, 5, 6)])
def test_solve_and_min_peak_respect_barriers_and_match_brute_force(seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    chain = random_chain(rng, n, hi=int(rng.choice([4, 20, 60])))
    joinable = tuple(bool(v) for v in rng.integers(0, 2, n + 1))
    chain = dataclasses.replace(chain, joinable=joinable)
    plans = [
        (chain_peak(chain, ops), simulate(chain, ops).total_ms)
        for ops in all_plans(n, nested=True)
        if not _crosses(ops, joinable)
    ]
    lowest = min(peak for peak, _ in plans)
    assert chain_peak(chain, min_peak_plan(chain)) == lowest
    assert not _crosses(min_peak_plan(chain), joinable)
    for headroom in budgets(peak for peak, _ in plans):
        ops = solve(chain, headroom, nested=True)
        fitting = [ms for peak, ms in plans if peak <= headroom]
        if headroom < lowest:
            assert ops is None and not fitting
            continue
        assert ops is not None and not _crosses(ops, joinable), (joinable, ops)
        assert chain_peak(chain, ops) <= headroom
        assert simulate(chain, ops).total_ms == pytest.approx(min(fitting), rel=1e-12, abs=1e-12)


def test_one_bare_simulation_gives_the_chain_and_the_full_peak() -> None:
    # What makes the brute-force oracles above one simulation per plan: against two simulations.
    rng = np.random.default_rng(77)
    for _ in range(30):
        chain = with_grads(rng, random_chain(rng, int(rng.integers(1, 6)), hi=50, negative_keep=True), 50)
        for ops in list(all_plans(chain.n))[:40]:
            peak, full, ms = measured(chain, ops)
            sim = simulate(chain, ops)
            assert (peak, full, ms) == (chain_peak(chain, ops), sim.peak_bytes, pytest.approx(sim.total_ms))


def _respects(chain: Chain, ops: tuple[Op, ...]) -> bool:
    """Whether every segment of a plan (at any depth) starts where a segment may start, recomputes only
    blocks that may be recomputed, and goes on only across joinable boundaries."""
    for op in ops:
        if isinstance(op, Recompute):
            inside = range(op.start, op.stop)
            if not chain.startable[op.start] or not all(chain.recomputable[k] for k in inside):
                return False
            if not all(chain.joinable[k] for k in range(op.start, op.stop - 1)) or not _respects(chain, op.inner):
                return False
    return True


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "knapsack"])
@pytest.mark.parametrize("seed", range(10))
def test_solve_respects_where_segments_may_start_and_go_as_the_brute_force_does(seed: int, nested: bool) -> None:
    # A block that edits the previous block's output in place may be recomputed only in a segment that
    # starts before it (Chain.startable); a stateful one never (recomputable); segments go on only across
    # joinable boundaries. The DP's best plan at every headroom is the best of the brute force's allowed plans.
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(3, 7))
    chain = random_chain(rng, n, hi=int(rng.choice([4, 20, 60])))
    recomputable = tuple(bool(v) for v in rng.random(n) > 0.15) + (True,)
    startable = tuple(r and bool(v) for r, v in zip(recomputable, rng.random(n + 1) > 0.4, strict=True))
    joinable = tuple(bool(v) for v in rng.random(n) > 0.2) + (True,)
    chain = dataclasses.replace(chain, recomputable=recomputable, startable=startable, joinable=joinable)
    b = bare(chain)
    plans = [measured(chain, ops, b) for ops in all_plans(n, nested=nested) if _respects(chain, ops)]
    lowest = min(peak for peak, _, _ in plans)
    for headroom in budgets(peak for peak, _, _ in plans):
        ops = solve(chain, headroom, nested=nested)
        fitting = [ms for peak, _, ms in plans if peak <= headroom]
        if headroom < lowest:
            assert ops is None and not fitting
            continue
        assert ops is not None and _respects(chain, ops), ops
        assert chain_peak(chain, ops) <= headroom
        assert simulate(chain, ops).total_ms == pytest.approx(min(fitting), rel=1e-12, abs=1e-12)
    assert min_peak(chain, nested=nested) == min(full for _, full, _ in plans)
    assert _respects(chain, min_peak_plan(chain, nested=nested))


@pytest.mark.parametrize("n", [4, 30, 100, 225, 600])
def test_the_finer_solve_at_the_smallest_budget_fits_the_table_size_on_long_chains(n: int) -> None:
    # A budget within rounding of the smallest peak is solved again in finer units. It took 65536 units
    # whatever the chain: 225 split blocks of a U-Net asked numpy for 24.8 GiB (a raw MemoryError).
    from remat.plan.solver import _TABLE_MAX_BYTES, _auto_slots, finest_slots

    slots = finest_slots(n, headroom_bytes=1 << 40)
    assert 16 * (n + 1) ** 2 * (slots + 1) <= max(_TABLE_MAX_BYTES, 16 * (n + 1) ** 2 * (_auto_slots(n) + 1))
    assert slots >= _auto_slots(n)  # never coarser than the first solve
    if n <= 30:
        assert slots == 1 << 16  # short chains keep the finest units
    assert finest_slots(n, headroom_bytes=100) == min(100, slots)  # never finer than a byte
