"""benchmarks/peers.py on tiny sizes: every eager row is set up, measured and timed, the tables print.

The compiled rows are left out (an inductor compile takes tens of seconds on 2 cores); the script's
own ``--small`` run covers them.
"""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.benchmark_scripts import load


@pytest.fixture(scope="module")
def peers() -> ModuleType:
    return load("peers")


@pytest.mark.parametrize("name", ["A", "B", "gpt2"])
def test_small_workload_runs_every_eager_row(peers: ModuleType, name: str) -> None:
    if name == "gpt2":
        pytest.importorskip("transformers")
    result = peers.run_workload(name, small=True, rounds=2, compile_budgets=(), profile_repeats=1)
    rows = {r["row"]: r for r in result["rows"]}
    peer_labels = [r["row"] for r in result["rows"] if r["kind"] == "peer"]
    assert peer_labels == (["HF gradient_checkpointing"] if name == "gpt2" else ["torch per-block", peer_labels[1]])
    # A remat row at every peer's measured peak, and at the two shares of none's, on the blocks and on
    # their children.
    remat_rows = [r for r in result["rows"] if r["kind"] == "remat"]
    budgets = ["50% of none", "20% of none", *(f"peak of {p}" for p in peer_labels)]
    assert [r["row"] for r in remat_rows] == [f"{tag} @ {b}" for tag in ("remat", "remat split") for b in budgets]
    for r in result["rows"]:
        if r.get("infeasible"):
            assert "smallest feasible peak" in r["infeasible"]
            continue
        assert r["peak_bytes"] > 0 and len(r["step_ms_all"]) == 2
        assert r["grads_equal"], r["row"]  # eager checkpointing leaves every gradient bitwise the same
    assert rows["none"]["peak_vs_none"] == 1.0
    assert rows["none"]["paired_overhead_vs_none"] == 0.0  # each round's step over itself
    assert all(r["paired_overhead_vs_none"] is not None for r in result["rows"] if r.get("step_ms_all"))
    text = peers.table(result)
    assert text.count("\n| ") == len(result["rows"]) + 1  # header + one line per row
    assert peers.targets(result)[-1].startswith(f"{name}: every remat plan")


def test_rotations_start_each_round_one_row_later(peers: ModuleType) -> None:
    assert list(peers.rotations(3, 3)) == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
