"""remat.plan on real profiles: budgets hold when measured, predictions match, errors, frontier."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Recompute
from remat.errors import BudgetInfeasibleError, RematError
from remat.models import Workload, workload
from remat.plan import planner
from remat.plan.planner import SOLVERS, Solver

from .test_strategies import fake_profile

MIB = 2**20


@pytest.mark.parametrize(
    "w",
    [
        workload("gpt", n_layers=6, d_model=48, n_heads=2, seq_len=32, batch=2, vocab_size=64, dropout=0.1),
        workload("mlp", widths=(32,) + (128, 48, 256, 32, 192, 80, 384, 64) * 3, batch=64),
    ],
    ids=["gpt", "mlp"],
)
def test_optimal_plans_fit_their_budget_when_measured(w: Workload) -> None:
    # Gradients held (zeroed in place): on models this small their bytes would make 30% infeasible;
    # loops that set them to None are tested in tests/measure/test_iteration.py.
    prof = remat.profile(w.model, w.inputs, w.loss_fn, repeats=1, grads="held")
    unplanned = remat.measure(w.model, w.inputs, w.loss_fn, steps=1, grads="held").peak_bytes
    for share in (0.3, 0.5, 0.7):
        budget = int(share * unplanned)
        plan = remat.plan(prof, budget)
        assert plan.predicted_peak_bytes is not None and plan.predicted_peak_bytes <= budget
        remat.apply(w.model, plan)
        measured = remat.measure(w.model, w.inputs, w.loss_fn, steps=1, grads="held").peak_bytes
        remat.remove(w.model)
        assert measured <= budget + max(0.05 * budget, MIB), (share, measured, budget, plan.describe())
        assert abs(measured - plan.predicted_peak_bytes) <= 0.10 * plan.predicted_peak_bytes, (share, plan.describe())
        assert remat.check_gradients(w.model, plan, w.inputs, w.loss_fn).equal


def test_budget_as_share_bytes_and_errors(small_mlp: Workload) -> None:
    prof = remat.profile(small_mlp.model, small_mlp.inputs, small_mlp.loss_fn, repeats=1, grads="held")
    share = remat.plan(prof, "60%")
    assert share.budget_bytes == int(0.6 * prof.peak_bytes)
    assert remat.plan(prof, share.budget_bytes).ops == share.ops
    with pytest.raises(
        BudgetInfeasibleError,
        match=r"budget 1B is below the smallest feasible peak [0-9.]+KiB \(optimal: .*\); raise the budget",
    ) as err:
        remat.plan(prof, "1B")
    assert err.value.budget_bytes == 1 and err.value.min_peak_bytes > 1
    # The smallest feasible peak itself is feasible.
    assert remat.plan(prof, err.value.min_peak_bytes).predicted_peak_bytes == err.value.min_peak_bytes
    with pytest.raises(RematError, match="unknown solver 'greedy'; valid solvers are optimal, knapsack"):
        remat.plan(prof, "50%", solver="greedy")
    with pytest.raises(RematError, match="a budget is needed"):
        remat.plan(prof)
    with pytest.raises(RematError, match="not both"):
        remat.plan(prof, "50%", strategy=remat.full())


def test_knapsack_is_single_level_and_never_faster_than_optimal(small_gpt: Workload) -> None:
    prof = remat.profile(small_gpt.model, small_gpt.inputs, small_gpt.loss_fn, repeats=1, grads="held")
    for share in ("45%", "60%", "80%"):
        best = remat.plan(prof, share)
        single = remat.plan(prof, share, solver="knapsack")
        assert single.depth <= 1
        assert all(op.stop - op.start == 1 for op in single.ops if isinstance(op, Recompute))
        assert best.predicted_extra_ms is not None and single.predicted_extra_ms is not None
        assert best.predicted_extra_ms <= single.predicted_extra_ms + 1e-9


def test_frontier_trades_memory_for_time_monotonically(small_gpt: Workload) -> None:
    prof = remat.profile(small_gpt.model, small_gpt.inputs, small_gpt.loss_fn, repeats=1)
    front = remat.frontier(prof, points=8)
    assert len(front.points) >= 2
    peaks = [p.peak_bytes for p in front.points]
    extras = [p.extra_ms for p in front.points]
    assert peaks == sorted(peaks) and extras == sorted(extras, reverse=True)
    assert all(p.peak_bytes <= max(p.budget_bytes, peaks[0]) for p in front.points)
    labels = [label for label, _, _ in front.strategies]
    assert "full" in labels and "none" in labels
    # No seed strategy beats the frontier: for its peak, the optimal plan is at least as fast
    # (0.2% of slack for the memory discretisation, NOTE [ Rotor dynamic program ]).
    for label, peak, extra in front.strategies:
        if peak >= peaks[0]:
            best = remat.plan(prof, int(peak * 1.002))
            assert best.predicted_extra_ms is not None and best.predicted_extra_ms <= extra + 1e-6, label


def test_solvers_are_registry_objects_and_messages_list_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    prof = fake_profile([5, 50, 20, 80], [1.0, 2.0, 1.0, 2.0])
    assert SOLVERS["optimal"] == Solver("optimal", nests=True, sub_variants=True, op_variants=True)
    assert SOLVERS["compile"] == Solver("compile", nests=False, sub_variants=True, top_level_variants=True)
    assert SOLVERS["knapsack"] == Solver("knapsack", nests=False, sub_variants=False)
    # A solver added to the registry is one remat.plan and remat.frontier use, and the messages name.
    monkeypatch.setitem(planner.SOLVERS, "single", Solver("single", nests=False, sub_variants=False))
    single = remat.plan(prof, 220, solver="single")
    assert single.strategy == "single" and single.ops == remat.plan(prof, 220, solver="knapsack").ops
    with pytest.raises(
        RematError, match=r"plan: unknown solver 'greedy'; valid solvers are optimal, knapsack, compile, single \("
    ):
        remat.plan(prof, "50%", solver="greedy")
    with pytest.raises(
        RematError, match=r"frontier: unknown solver 'greedy'; valid solvers are optimal, knapsack, compile, single"
    ):
        remat.frontier(prof, solver="greedy")


def test_a_plan_predicted_above_its_budget_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    # Should a solver's tables ever disagree with the simulation (a variant's costs), plan() checks the
    # prediction: here a broken solver proposes keeping everything, far above the budget.
    from remat.core.ops import Keep

    class Broken(Solver):
        def solve(self, profile, chain, headroom, *, slots=None):  # type: ignore[no-untyped-def]
            return tuple(Keep(i) for i in range(chain.n))

    prof = fake_profile([5, 50, 20, 80], [1.0, 2.0, 1.0, 2.0])
    monkeypatch.setitem(planner.SOLVERS, "broken", Broken("broken", nests=True, sub_variants=False))
    plan = remat.plan(prof, 220, solver="broken")  # its lowest-peak plan instead, which fits
    assert plan.predicted_peak_bytes is not None and plan.predicted_peak_bytes <= 220
    assert plan.ops != tuple(Keep(i) for i in range(4))
    with pytest.raises(BudgetInfeasibleError, match="smallest"):
        remat.plan(prof, plan.predicted_peak_bytes - 1, solver="broken")


def test_tables_above_the_lowest_plans_prediction_do_not_make_a_budget_infeasible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The DP tables never go below the simulation but may go above it (a late input held across
    # segments: a ResNet with a frozen, eval-mode prefix had its floor put 13% above its lowest plan's
    # prediction, and budgets between were called infeasible). Here a solver whose tables are 40 bytes
    # pessimistic: the lowest-peak plan's prediction decides.
    class Pessimistic(Solver):
        def solve(self, profile, chain, headroom, *, slots=None):  # type: ignore[no-untyped-def]
            return super().solve(profile, chain, headroom - 40, slots=slots)

        def min_peak(self, profile, chain):  # type: ignore[no-untyped-def]
            return super().min_peak(profile, chain) + 40

    prof = fake_profile([5, 50, 20, 80, 40, 10], [1.0, 2.0, 1.0, 2.0, 3.0, 1.0])
    monkeypatch.setitem(planner.SOLVERS, "pessimistic", Pessimistic("pessimistic", nests=True, sub_variants=False))
    with pytest.raises(BudgetInfeasibleError) as exact:
        remat.plan(prof, 120, solver="optimal")
    lowest = exact.value.min_peak_bytes
    got = remat.plan(prof, lowest, solver="pessimistic")
    assert got.predicted_peak_bytes == lowest
    with pytest.raises(BudgetInfeasibleError) as info:
        remat.plan(prof, lowest - 1, solver="pessimistic")
    assert info.value.min_peak_bytes == lowest


def test_a_solver_a_few_bytes_off_is_solved_again_below_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # A solver whose tables are a few bytes optimistic: plan() solves again for a budget lowered by the
    # simulated excess, so the plan is the one the exact solver picks, not the slow lowest-peak plan.
    class Optimistic(Solver):
        def solve(self, profile, chain, headroom, *, slots=None):  # type: ignore[no-untyped-def]
            return super().solve(profile, chain, headroom + 9, slots=slots)

    prof = fake_profile([5, 50, 20, 80, 40, 10], [1.0, 2.0, 1.0, 2.0, 3.0, 1.0])
    monkeypatch.setitem(planner.SOLVERS, "optimistic", Optimistic("optimistic", nests=True, sub_variants=False))
    checked = 0
    for budget in range(150, 260, 3):
        try:
            exact = remat.plan(prof, budget, solver="optimal")
        except BudgetInfeasibleError:
            continue
        got = remat.plan(prof, budget, solver="optimistic")
        assert got.predicted_peak_bytes is not None and got.predicted_peak_bytes <= budget
        assert got.predicted_extra_ms == exact.predicted_extra_ms, budget
        checked += 1
    assert checked > 10


def test_a_strategy_given_as_the_budget_is_pointed_to_strategy() -> None:
    prof = fake_profile([100, 100, 100, 100], [1.0, 1.0, 1.0, 1.0])
    with pytest.raises(
        RematError, match=r"plan: budget 'full' is a strategy, not a memory budget; did you mean strategy='full'\?"
    ):
        remat.plan(prof, "full")
    with pytest.raises(RematError, match=r"plan: budget Full\(\) is a strategy.*did you mean strategy='full'\?"):
        remat.plan(prof, remat.full())  # type: ignore[arg-type]
    with pytest.raises(RematError, match=r"did you mean strategy='every_nth\(2\)'\?"):
        remat.plan(prof, "every_nth(2)")


class _Vgg(nn.Module):
    """A VGG in miniature: convolutions, BatchNorm and in-place ReLUs in one Sequential, then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = 3
        for width in (8, 8, 16, 16):
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
            c = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def test_few_coarse_blocks_that_cannot_lower_the_peak_say_to_profile_finer_ones() -> None:
    torch.manual_seed(0)
    model = _Vgg()
    x = torch.randn(8, 3, 32, 32)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    # (remat.blocks gives the children of `features` itself, a repeating pattern: NOTE [ Repeating patterns ])
    coarse_blocks = remat.blocks(model, include=["features", "pool", "classifier"])
    coarse = remat.profile(model, x, loss_fn, blocks=coarse_blocks, repeats=1, progress=False)
    assert [b.name for b in coarse.blocks] == ["features", "pool", "classifier"]
    with pytest.raises(
        remat.BudgetInfeasibleError,
        match=r"profile finer blocks, remat\.blocks\(model, split=True\) or include=\['features\.\*'\]",
    ):
        remat.plan(coarse, "50%")
    # The hint names this model's own block that saves the most, not a fixed example.
    renamed = _Vgg()
    renamed.body = renamed.features
    del renamed.features
    renamed.forward = lambda x: renamed.classifier(torch.flatten(renamed.pool(renamed.body(x)), 1))  # type: ignore[method-assign]
    blocks = remat.blocks(renamed, include=["body", "pool", "classifier"])
    prof = remat.profile(renamed, x, loss_fn, blocks=blocks, repeats=1, progress=False)
    with pytest.raises(remat.BudgetInfeasibleError, match=r"include=\['body\.\*'\]"):
        remat.plan(prof, "50%")
    # Its children as blocks: segments over [Conv, BatchNorm, ReLU(inplace=True)] lower the peak.
    fine = remat.profile(model, x, loss_fn, blocks=remat.blocks(model, split=True), repeats=1, progress=False)
    with pytest.raises(remat.BudgetInfeasibleError) as info:
        remat.plan(fine, "1KiB")
    assert "finer blocks" not in str(info.value) and info.value.min_peak_bytes < 0.8 * fine.peak_bytes
