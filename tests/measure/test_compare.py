"""remat.measure.compare: the bench engine's run-to-run spread, driven by a fake timer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import remat
from remat.apply import to_plan
from remat.measure import compare as compare_module
from remat.measure.compare import BenchResult, BenchRow, compare, separable, spread_pct
from tests.conftest import tiny_net_workload


def _fake_timer(monkeypatch: pytest.MonkeyPatch, per_round: list[list[float]]) -> None:
    """Replace the step timer: round r gives plan i ``per_round[r][i]`` milliseconds."""
    order: Iterator[float] = iter(t for round_ in per_round for t in round_)
    monkeypatch.setattr(compare_module, "timed_steps", lambda step, device, repeats: [next(order)])


def _bench(monkeypatch: pytest.MonkeyPatch, per_round: list[list[float]]) -> BenchResult:
    w = tiny_net_workload()
    plans = [to_plan(remat.none(), w.model), to_plan(remat.full(), w.model)]
    _fake_timer(monkeypatch, per_round)
    return compare(w.model, w.inputs, w.loss_fn, plans, rounds=len(per_round))


def test_spread_is_interquartile_range_over_median() -> None:
    assert spread_pct([100.0, 100.0, 100.0]) == 0.0
    assert spread_pct([90.0, 100.0, 110.0]) == pytest.approx(10.0)  # quartiles 95 and 105
    assert spread_pct([100.0]) is None


def test_calm_timer_ranks_the_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _bench(monkeypatch, [[100.0, 130.0], [101.0, 131.0], [99.0, 129.0], [100.0, 130.0], [100.0, 130.0]])
    none, full = result.rows
    assert none.step_ms == 100.0 and full.step_ms == 130.0
    assert none.spread_pct == pytest.approx(0.0) and full.spread_pct == pytest.approx(0.0)
    assert separable(none, full) and result.rankable
    assert result.noise_pct == pytest.approx(0.0) and result.difference_pct == pytest.approx(30.0)


def test_noisy_timer_cannot_rank_the_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    # The demo: `none` at 310/131/168/267/148 ms, a plan that costs 10% more just as scattered.
    noisy = [[310.0, 150.0], [131.0, 330.0], [168.0, 180.0], [267.0, 290.0], [148.0, 160.0]]
    result = _bench(monkeypatch, noisy)
    none, full = result.rows
    assert none.step_ms == 168.0 and full.step_ms == 180.0
    assert none.spread_pct == pytest.approx(100.0 * (267 - 148) / 168)
    assert not separable(none, full) and not result.rankable
    assert '"rankable": false' in result.to_json()


def test_one_round_is_never_ranked(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _bench(monkeypatch, [[100.0, 200.0]])
    assert result.rows[0].spread_pct is None and result.noise_pct is None
    assert not result.rankable and not separable(*result.rows)


def test_the_model_is_left_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    w = tiny_net_workload()
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    _fake_timer(monkeypatch, [[1.0, 2.0]] * 3)
    compare(w.model, w.inputs, w.loss_fn, [to_plan(remat.none(), w.model), to_plan(remat.full(), w.model)], rounds=3)
    assert remat.applied(w.model) is None
    assert all(torch.equal(v, before[k]) for k, v in w.model.state_dict().items())


def _row(label: str, step_ms: float, spread: float | None) -> BenchRow:
    return BenchRow(
        label=label, checkpointed=0, n_blocks=1, depth=0, peak_bytes=1, step_ms=step_ms, step_ms_all=(step_ms,),
        saved_pct=0.0, overhead_pct=0.0, grads_equal=True, forward_counts={}, predicted_peak_bytes=None,
        predicted_extra_ms=None, budget_bytes=None, ops="", spread_pct=spread,
    )  # fmt: skip


def test_separable_needs_a_difference_beyond_both_spreads() -> None:
    assert separable(_row("a", 100.0, 5.0), _row("b", 110.0, 5.0))  # 10% apart, 5% spread
    assert not separable(_row("a", 100.0, 5.0), _row("b", 110.0, 12.0))  # 10% apart, one plan spreads 12%
    assert not separable(_row("a", 100.0, None), _row("b", 200.0, 1.0))  # spread unknown: no claim
