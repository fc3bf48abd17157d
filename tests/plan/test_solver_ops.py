"""Op-level policies (RecomputeOps) as ways of keeping a block in the DP: exact against brute force,
top level only (NOTE [ Keep variants ])."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from remat.core.ops import Keep, Op, Recompute, RecomputeOps, RecomputeSub, ops_from_json, ops_to_json, validate_ops
from remat.errors import RematError
from remat.plan.chain import Chain
from remat.plan.solver import Simulation, VariantId, all_plans, min_peak, min_peak_plan, simulate, solve
from tests.plan.test_solver import budgets, random_chain, with_grads


def random_variants(rng: np.random.Generator, chain: Chain) -> dict[tuple[int, VariantId], tuple[int, float]]:
    """On some blocks an attention sub-module and one or two op-level policies, each freeing part of keep_bytes."""
    costs: dict[tuple[int, VariantId], tuple[int, float]] = {}
    for k in range(chain.n):
        if rng.integers(0, 2):
            costs[(k, (f"{k}.attn",))] = (
                int(rng.integers(0, max(1, chain.keep_bytes[k]) + 1)),
                float(rng.uniform(0.5, 3)),
            )
        for j in range(int(rng.integers(0, 3))):
            op = RecomputeOps(k, save=(f"mm#{j}",), recompute=(f"gelu#{j}",))
            # Cheaper than the block's forward and freeing less than all it keeps, like a real policy.
            costs[(k, op)] = (int(rng.integers(0, max(1, chain.keep_bytes[k]) + 1)), float(rng.uniform(0.0, 1.0)))
    return costs


def _groups(costs: dict[tuple[int, VariantId], tuple[int, float]]) -> dict[int, list[VariantId]]:
    groups: dict[int, list[VariantId]] = {}
    for k, variant in costs:
        groups.setdefault(k, []).append(variant)
    return groups


def test_plan_space_puts_policies_at_the_top_level_only() -> None:
    op = RecomputeOps(0, ("mm#0",), ("gelu#0",))
    plans = list(all_plans(2, subs={0: [op], 1: [RecomputeSub(1, ("1.attn",)).fqns]}))
    with_op = [p for p in plans if op in p]
    assert with_op, "the plan space has no plan keeping block 0 under its policy"
    for ops in plans:
        for top in ops:
            if isinstance(top, Recompute):
                assert not any(isinstance(inner, RecomputeOps) for inner in top.inner), ops
    # Without the rule, K0 could sit inside R[0:2](...): the space would be larger.
    assert len(plans) < len(list(all_plans(2, subs={0: [("0.attn",)], 1: [("1.attn",)]})))


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "knapsack"])
@pytest.mark.parametrize("seed", range(16))
def test_solve_with_op_policies_matches_brute_force(seed: int, nested: bool) -> None:
    rng = np.random.default_rng(9000 + seed)
    n = int(rng.integers(1, 6))
    chain = random_chain(rng, n, hi=int(rng.choice([20, 60])), negative_keep=seed % 3 == 2)
    if seed % 2:
        chain = with_grads(rng, chain, 40)
    costs = random_variants(rng, chain)
    plans = [
        (_chain_peak(chain, ops, costs), simulate(chain, ops, costs).total_ms, ops)
        for ops in all_plans(n, nested=nested, subs=_groups(costs))
    ]
    lowest = min(peak for peak, _, _ in plans)
    full_peaks = [simulate(chain, ops, costs).peak_bytes for _, _, ops in plans]
    assert min_peak(chain, nested=nested, sub_costs=costs) == min(full_peaks)
    assert simulate(chain, min_peak_plan(chain, nested=nested, sub_costs=costs), costs).peak_bytes == min(full_peaks)
    for headroom in budgets(peak for peak, _, _ in plans):
        ops = solve(chain, headroom, nested=nested, sub_costs=costs)
        fitting = [ms for peak, ms, _ in plans if peak <= headroom]
        if headroom < lowest:
            assert ops is None and not fitting
            continue
        assert ops is not None, f"headroom {headroom} >= lowest chain peak {lowest} but solve found no plan"
        validate_ops(ops, n)  # in particular: no policy inside a segment
        assert _chain_peak(chain, ops, costs) <= headroom
        assert simulate(chain, ops, costs).total_ms == pytest.approx(min(fitting), rel=1e-12, abs=1e-12)


def _chain_peak(chain: Chain, ops: tuple[Op, ...], costs: dict[tuple[int, VariantId], tuple[int, float]]) -> int:
    """The simulated peak of the chain alone, above ``base_bytes`` (as test_solver.chain_peak, with variants)."""
    bare = dataclasses.replace(chain, base_bytes=0, pre_peak_bytes=-(10**18), tail_peak_bytes=-(10**18))
    return simulate(bare, ops, costs).peak_bytes


def test_policy_by_hand() -> None:
    # Block 0 (S 100, fp 100, bp 20): a policy frees 70 bytes for 0.5 ms, its attention 80 bytes for 1 ms.
    # Block 1 (S 50, fp 50, bp 10). Keep-all peaks at 160.
    chain = Chain(
        fwd_ms=(10.0, 5.0, 0.0),
        bwd_ms=(10.0, 5.0, 0.0),
        x_bytes=(10, 10, 10),
        keep_bytes=(100, 50, 0),
        fwd_peak_bytes=(100, 50, 0),
        bwd_peak_bytes=(20, 10, 0),
    )
    op = RecomputeOps(0, ("addmm#0",), ("gelu#0",))
    costs: dict[tuple[int, VariantId], tuple[int, float]] = {(0, op): (70, 0.5), (0, ("0.attn",)): (80, 1.0)}
    # fwd O0: 100, L=30; K1: 80, L=80; bwd K1 90, L=30; bwd O0 30+20+70 = 120.
    assert simulate(chain, (op, Keep(1)), costs) == Simulation(peak_bytes=120, total_ms=30.5, extra_ms=0.5)
    # At 125 both variants fit (S0: 120 at 1 ms): the policy is faster.
    assert solve(chain, 125, sub_costs=costs) == (op, Keep(1))
    assert solve(chain, 160, sub_costs=costs) == (Keep(0), Keep(1))


def test_policy_inside_a_segment_is_refused() -> None:
    op = RecomputeOps(0, ("addmm#0",), ("gelu#0",))
    with pytest.raises(RematError, match="op-level policies apply to blocks kept at the top level"):
        validate_ops((Recompute(0, 2, (op, Keep(1))),), 2)
    validate_ops((op, Keep(1)), 2)


def test_policy_json_round_trip() -> None:
    ops = (RecomputeOps(0, ("addmm#0", "bmm#1"), ("gelu#0",)), Recompute(1, 3, (Keep(1), Keep(2))))
    assert ops_from_json(ops_to_json(ops)) == ops
