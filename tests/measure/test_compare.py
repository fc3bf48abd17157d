"""remat.measure.compare: the bench engine's run-to-run spread, driven by a fake timer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import remat
from remat.measure import compare as compare_module
from remat.measure.compare import BenchResult, BenchRow, compare, separable, spread_pct
from remat.plan.planner import to_plan
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


# --- bench.json: BenchResult round-trips through JSON ---------------------------------------------


def _none_and_full(model: torch.nn.Module) -> tuple[remat.Plan, remat.Plan]:
    """The plain plan and the recompute-everything plan of ``model``'s blocks, made by hand."""
    from remat.core.ops import Keep, Recompute

    blocks = remat.blocks(model)
    none = remat.Plan("none", blocks, tuple(Keep(i) for i in range(len(blocks))))
    return none, remat.Plan("full", blocks, tuple(Recompute(i, i + 1, (Keep(i),)) for i in range(len(blocks))))


def test_bench_json_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.measure.compare import BenchPlan

    w = tiny_net_workload()
    none, full = _none_and_full(w.model)
    _fake_timer(monkeypatch, [[100.0, 130.0], [101.0, 131.0], [99.0, 129.0]])
    result = compare(w.model, w.inputs, w.loss_fn, [none, BenchPlan(full, "optimal")], rounds=3)
    assert [r.plan for r in result.rows] == [none, full] and [r.solver for r in result.rows] == [None, "optimal"]
    assert BenchResult.from_json(result.to_json()) == result
    # Rows without a plan (hand-made, or files written before rows carried plans) round-trip too.
    bare = BenchResult(model="m", device="cpu", held_bytes=3, rounds=1, rows=(_row("a", 1.0, None),))
    assert BenchResult.from_json(bare.to_json()) == bare


def test_a_plan_finds_its_row_by_the_plan_not_by_its_label(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    w = tiny_net_workload()
    none, full = _none_and_full(w.model)
    _fake_timer(monkeypatch, [[100.0, 130.0]])
    result = compare(w.model, w.inputs, w.loss_fn, [none, full], rounds=1)
    assert result.row_of(full) is result.rows[1] and result.row_of(none) is result.rows[0]
    assert result.row_of(replace(full, strategy="none")) is None  # same label as a row, another plan
    # A row read from an older file has no plan: its label and compact form must both match.
    old = replace(result, rows=tuple(replace(r, plan=None) for r in result.rows))
    assert old.row_of(full) is old.rows[1] and old.row_of(replace(full, strategy="fully")) is None


def _bench_json(change: object) -> str:
    import json

    data = json.loads(
        BenchResult(model="m", device="cpu", held_bytes=3, rounds=1, rows=(_row("a", 1.0, 2.0),)).to_json()
    )
    change(data)  # type: ignore[operator]
    return json.dumps(data)


FIX = r"measure again with `remat bench MODEL --json bench\.json`"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d.pop("rows"), rf"^bench json: missing field 'rows'; {FIX}"),
        (lambda d: d["rows"][0].pop("peak_bytes"), r"^bench json: missing field 'rows\[0\]\.peak_bytes'; "),
        (lambda d: d.update(rows={}), r"^bench json: field 'rows' is an object, expected a list; "),
        (lambda d: d["rows"][0].update(step_ms="fast"), r"field 'rows\[0\]\.step_ms' is \"fast\", expected a number"),
        (lambda d: d["rows"][0].update(forward_counts=[1]), r"field 'rows\[0\]\.forward_counts' is a list of 1, expected an object"),
        (lambda d: d["loop"].update(grads="kept"), r"field 'loop\.grads' is \"kept\", expected one of \"none\", \"held\""),
        (lambda d: d.update(schema_version=2), r"^bench json: schema_version 2 is not 1; "),
        (lambda d: d["rows"][0].update(plan={"strategy": "x"}), r"^bench json: missing field 'rows\[0\]\.plan\.blocks'; "),
    ],
)  # fmt: skip
def test_a_bad_bench_file_names_the_field_and_the_fix(change: object, match: str) -> None:
    from remat.errors import RematError

    with pytest.raises(RematError, match=match):
        BenchResult.from_json(_bench_json(change))


def test_a_bad_plan_in_a_bench_row_is_named_by_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from remat.errors import RematError

    w = tiny_net_workload()
    _fake_timer(monkeypatch, [[100.0]])
    data = json.loads(compare(w.model, w.inputs, w.loss_fn, [_none_and_full(w.model)[1]], rounds=1).to_json())
    data["rows"][0]["plan"]["ops"].reverse()
    with pytest.raises(
        RematError,
        match=r"^bench json: rows\[0\]\.plan\.ops: plan operation R\[4:5\]\(K4\) at position 0 spans blocks 4\.\.4",
    ):
        BenchResult.from_json(json.dumps(data))
    data["rows"][0]["plan"]["blocks"][0]["index"] = 7
    with pytest.raises(RematError, match=r"^bench json: field 'rows\[0\]\.plan\.blocks\[0\]\.index' is 7, expected 0"):
        BenchResult.from_json(json.dumps(data))


def test_the_noise_figures_are_written_for_people_and_recomputed_when_read(caplog: pytest.LogCaptureFixture) -> None:
    import json
    import logging

    text = _bench_json(lambda d: d.update(rankable=False, noise_pct=99.0))
    assert json.loads(text)["rankable"] is False
    with caplog.at_level(logging.WARNING, logger="remat._json"):
        back = BenchResult.from_json(text)
    assert back.rankable and back.noise_pct == 2.0 and caplog.text == ""  # from the rows, whatever the file says
    with caplog.at_level(logging.WARNING, logger="remat._json"):
        BenchResult.from_json(_bench_json(lambda d: d["rows"][0].update(peak=1)))
    assert "bench json: ignoring unknown field 'peak' in 'rows[0]'" in caplog.text


def test_timed_step_is_not_the_learning_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ The learning step is not timed ]: every recomputed block's runtime role has learned (its first
    # call after apply, about 5-20 ms per layer of the default GPT) before the bench times a step.
    w = tiny_net_workload()
    plans = [to_plan(remat.none(), w.model), to_plan(remat.full(), w.model)]
    seen: list[tuple[int, int]] = []

    def timer(step, device, repeats):  # type: ignore[no-untyped-def]
        roles = [m.__dict__["_remat_role"] for m in w.model.modules() if "_remat_role" in m.__dict__]
        seen.append((len(roles), sum(not r.learned for r in roles)))
        return [1.0]

    monkeypatch.setattr(compare_module, "timed_steps", timer)
    compare(w.model, w.inputs, w.loss_fn, plans, rounds=3)
    assert len(seen) == 6
    assert sum(n for n, _ in seen[1::2]) > 0  # full()'s rounds have roles
    assert all(unlearned == 0 for _, unlearned in seen), seen
