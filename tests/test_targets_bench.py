"""benchmarks/targets.py on tiny sizes: none and every planned row are timed round by round, the table prints."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load


@pytest.mark.parametrize("name", ["A", "B"])
def test_small_workload_times_none_and_each_plan_and_pairs_them(name: str) -> None:
    targets = load("targets")
    rows = targets.run(name, ["90%", "1%"], rounds=3, small=True)
    assert [r["row"] for r in rows] == [
        "none",
        *(f"{tag} @ {share}" for tag in ("remat", "remat split") for share in ("90%", "1%")),
    ]
    assert all("infeasible" in r for r in rows if r["row"].endswith("1%"))  # below any plan
    timed = [r for r in rows if "times_ms" in r]
    assert len(timed) == 3 and all(len(r["times_ms"]) == 3 for r in timed)
    for r in timed[1:]:
        assert r["grads_equal"] and r["peak_bytes"] <= 1.05 * r["budget_bytes"], r
    text = targets.table(name, rows)
    assert text.count("\n| ") == len(rows) + 1 and "infeasible (least" in text
    assert text.count("\n- ") == len(timed) - 1  # each plan, described
