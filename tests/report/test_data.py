"""A report's values as JSON files (NOTE [ Report files ] in remat.report.data): written, read back equal,
the report drawn again from them by ``remat report --from DIR`` with nothing measured or planned."""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from html import escape
from pathlib import Path

import pytest

from remat.cli.main import main
from remat.errors import RematError
from remat.measure.compare import BenchResult
from remat.plan.planner import plan as make_plan
from remat.plan.types import Plan
from remat.report import CHARTS, ReportData, build, heatmap_plan, write_charts, write_report

from .conftest import FIXTURES


def test_the_values_round_trip_through_their_files(data: ReportData, tmp_path: Path) -> None:
    written = data.write(tmp_path)
    assert [p.name for p in written] == [
        "profile.json",
        "plan.json",
        "bench.json",
        "frontier.json",
        *(f"timeline-{i}.json" for i in range(1, len(data.timelines) + 1)),
    ]
    assert ReportData.read(tmp_path) == data
    # Fewer timelines than the directory held: the stale files go, so the directory reads back as written.
    replace(data, timelines=data.timelines[:1]).write(tmp_path)
    assert ReportData.read(tmp_path).timelines == data.timelines[:1]


def test_every_bench_row_carries_its_plan_and_its_solver(data: ReportData) -> None:
    rows = data.result.rows
    assert all(r.plan is not None and r.plan.strategy == r.label and r.ops == r.plan.describe() for r in rows)
    assert {r.solver for r in rows} == {None, "optimal", "knapsack"}
    assert data.result.row_of(data.plan) is next(r for r in rows if r.solver == "optimal")


def test_the_heatmap_plan_is_the_benched_plan_not_solved_again(data: ReportData) -> None:
    picked = heatmap_plan(data.result)
    assert picked == data.plan
    # The same plan the planner makes for that budget (what the report used to solve again).
    assert picked is not None and picked.budget_bytes is not None
    # (The fixture's plans were written before plans recorded their profile's loop and input bytes: None.)
    again = make_plan(data.profile, picked.budget_bytes, solver="optimal")
    assert again.loop == data.profile.loop and picked.loop is None
    assert again.input_bytes == tuple(bp.input_bytes for bp in data.profile.block_profiles)
    assert picked.input_bytes is None
    assert picked == replace(again, strategy=picked.strategy, loop=None, input_bytes=None)
    # No optimal row: no plan to pick, and the bench's charts say so.
    strategies_only = replace(data.result, rows=tuple(r for r in data.result.rows if r.solver is None))
    assert heatmap_plan(strategies_only) is None


def test_a_directory_without_plan_json_reports_on_the_benched_plan(data: ReportData, tmp_path: Path) -> None:
    data.write(tmp_path)
    (tmp_path / "plan.json").unlink()
    assert ReportData.read(tmp_path).plan == data.plan
    bare = BenchResult(model="m", device="cpu", held_bytes=0, rounds=1, rows=())
    (tmp_path / "bench.json").write_text(bare.to_json())
    with pytest.raises(RematError, match=r"has no plan\.json and its bench has no optimal plan to report on; write"):
        ReportData.read(tmp_path)


@pytest.mark.parametrize("missing", ["profile.json", "bench.json", "frontier.json"])
def test_a_missing_file_is_named(data: ReportData, tmp_path: Path, missing: str) -> None:
    data.write(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(RematError, match=rf"^report: '.*' has no {missing}; give a directory written by `remat report"):
        ReportData.read(tmp_path)


def test_a_bad_file_is_named_by_its_kind(data: ReportData, tmp_path: Path) -> None:
    data.write(tmp_path)
    (tmp_path / "frontier.json").write_text(data.profile.to_json())
    with pytest.raises(RematError, match=r"^frontier json: missing field 'points' and 3 more"):
        ReportData.read(tmp_path)
    with pytest.raises(RematError, match=r"^report: '.*nowhere' is not a directory"):
        ReportData.read(tmp_path / "nowhere")


def test_build_writes_the_charts_the_documents_and_the_values(data: ReportData, tmp_path: Path) -> None:
    written = build(tmp_path, data, command="remat report gpt --budget 90%")
    assert list(written.charts) == list(CHARTS)
    assert [p.name for p in written.values] == [p.name for p in data.write(tmp_path / "again")]
    html, md = written.html.read_text(), written.markdown.read_text()
    for chart in CHARTS.values():  # one registry names the charts of both documents
        assert f"<h3>{chart.title}</h3>" in html and f"### {chart.title}" in md
        assert f"<figcaption>{escape(chart.caption)}</figcaption>" in html
    assert ReportData.read(tmp_path) == data


def test_without_timelines_the_timeline_chart_and_table_are_left_out(data: ReportData, tmp_path: Path) -> None:
    bench_only = replace(data, timelines=())
    charts = write_charts(tmp_path, bench_only)
    assert list(charts) == [name for name in CHARTS if name != "timeline"]
    html, md = write_report(tmp_path, command="remat report --from x", charts=charts, **vars(bench_only))
    assert "<h2>Timelines</h2>" not in html.read_text() and "## Timelines" not in md.read_text()
    assert "<h2>Charts</h2>" in html.read_text() and CHARTS["timeline"].title not in html.read_text()


@pytest.mark.usefixtures("nothing_planned")
def test_cli_report_from_json_files_measures_nothing(
    data: ReportData, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "values"
    shutil.copytree(FIXTURES, source)
    out = tmp_path / "rr"
    assert main(["report", "--from", str(source), "--out", str(out)]) == 0
    assert {"report.html", "report.md", "plan.json", "bench.json", *(f"{n}.png" for n in CHARTS)} <= {
        p.name for p in out.iterdir()
    }
    assert ReportData.read(out) == data
    text = (out / "report.html").read_text()
    assert f"remat report --from {source} --out {out}" in text and data.result.model in text
    printed = " ".join(capsys.readouterr().out.split())
    assert f"wrote {out / 'report.html'}" in printed and " saves " in printed


def test_cli_report_from_a_missing_directory_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--from", str(tmp_path / "none"), "--out", str(tmp_path / "rr")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: report: ") and "is not a directory" in err and err.count("\n") == 1
    assert not (tmp_path / "rr").exists()


def test_cli_report_takes_a_budget_or_a_directory_not_both(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as done:
        main(["report", "--budget", "40%", "--from", str(tmp_path)])
    assert done.value.code == 2


@pytest.fixture
def nothing_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Profiling, planning and benching raise: a report drawn from files must do none of them."""

    def forbidden(*args: object, **kwargs: object) -> Plan:
        raise AssertionError("planned or measured while drawing a report from values")

    for module, name in (
        ("remat.plan.planner", "plan"),
        ("remat.plan.frontier", "frontier"),
        ("remat.report.pipeline", "make_plan"),
        ("remat.report.pipeline", "compare"),
        ("remat.report.pipeline", "frontier"),
        ("remat.cli.report", "run_profile"),
    ):
        monkeypatch.setattr(sys.modules[module], name, forbidden)  # by module: remat.plan is also a function
