"""The HTML report and its Markdown summary, drawn from JSON fixtures; ``remat report --from``; and
``remat report`` end to end on a small GPT (the one test that runs the real pipeline)."""

from __future__ import annotations

import base64
import io
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from remat.cli.main import main
from remat.measure.compare import BenchResult, BenchRow
from remat.plan.types import LEGEND, Plan
from remat.report import write_report
from remat.report.html import verdict
from remat.units import format_bytes

from .conftest import BUDGET, SIZES

IMG = re.compile(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def decoded_pngs(text: str) -> list[np.ndarray]:
    import matplotlib.image

    return [
        np.asarray(matplotlib.image.imread(io.BytesIO(base64.b64decode(data)), format="png"))
        for data in IMG.findall(text)
    ]


def test_report_embeds_every_chart_and_the_tables(run: dict[str, Any], charts: dict[str, Path], tmp_path: Path) -> None:
    command = "remat report gpt --budget 60% --set n_layers=3"
    html_path, md_path = write_report(tmp_path, command=command, description="tiny <GPT> & co", charts=charts, **run)
    text = html_path.read_text()
    images = decoded_pngs(text)
    assert len(images) == 4
    for img in images:
        rgb = img[..., :3]
        assert rgb.shape[0] > 100 and float(rgb.std()) > 0.01 and float((rgb < 0.95).mean()) > 0.01
    assert "remat report gpt --budget 60% --set n_layers=3" in text
    for b in run["profile"].blocks:
        assert f"<td>{b.name}</td>" in text  # the profile table has a row per block
    for r in run["result"].rows:
        assert f"<td>{r.label}</td>" in text  # and the bench table a row per strategy
    assert run["plan"].describe() in text
    # Text is escaped; nothing outside the document is referenced.
    assert "tiny &lt;GPT&gt; &amp; co" in text and "<GPT>" not in text
    assert not re.search(r'(src|href)="(?!data:)', text)
    assert text.count("<style>") == 1 and "<link" not in text


def test_report_opens_with_a_verdict_and_says_the_plan_in_words(
    run: dict[str, Any], charts: dict[str, Path], tmp_path: Path
) -> None:
    plan: Plan = run["plan"]
    command = "remat report gpt --budget 60% --set n_layers=3"
    html_path, md_path = write_report(tmp_path, command=command, charts=charts, **run)
    text = html_path.read_text()
    sentence = verdict(plan, run["result"], run["profile"])
    assert text.index(f'<p class="verdict">{sentence}</p>') < text.index("<h2>Command</h2>")
    assert md_path.read_text().startswith(f"# remat report: {run['profile'].model}\n\n**{sentence}**")
    # The plan in words, one row per line of Plan.lines(), and the compact form only with its legend.
    for line in plan.lines():
        assert f">{plan.span(line.blocks)}</td><td" in text and f">{line.what}</td>" in text
    assert f"{plan.strategy}</b>: {plan.headline()}." in text and LEGEND in text
    assert "blocks recomputed, depth" not in text and "keep blocks" not in text
    # plan.json next to it, the plan itself, with the command that reuses it.
    assert Plan.from_json((tmp_path / "plan.json").read_text()) == plan
    assert f"remat measure gpt --set n_layers=3 --plan {tmp_path / 'plan.json'}" in text
    # The frontier in words: no compact operations, the chosen plan highlighted in it.
    frontier = text[text.index("<h2>Optimal frontier") :]
    assert "what it recomputes" in frontier and not re.search(r"\b[KRS]\d|R\[\d", frontier)
    assert re.search(r'<tr class="chosen">(<td[^>]*>[^<]*</td>){3}<td>the chosen plan: ', frontier)


def _row(
    label: str,
    peak_mib: float,
    step_ms: float,
    spread: float | None,
    *,
    budget_mib: float | None = None,
    equal: bool = True,
) -> BenchRow:
    base_peak, base_ms = 64.0, 100.0
    return BenchRow(
        label=label, checkpointed=0 if label == "none" else 3, n_blocks=4, depth=0 if label == "none" else 1,
        peak_bytes=int(peak_mib * 2**20), step_ms=step_ms, step_ms_all=(step_ms,),
        saved_pct=100 * (1 - peak_mib / base_peak), overhead_pct=100 * (step_ms / base_ms - 1), grads_equal=equal,
        forward_counts={}, predicted_peak_bytes=None, predicted_extra_ms=None,
        budget_bytes=None if budget_mib is None else int(budget_mib * 2**20), ops="", spread_pct=spread,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("plain_spread", "chosen", "expected"),
    [
        (3.0, _row("optimal", 25.0, 122.0, 4.0),
         "optimal saves 39.0MiB (61%) of the plain 64.0MiB peak for +22% step time (122.0ms against 100.0ms)."),
        (30.0, _row("optimal", 25.0, 122.0, 25.0),
         "optimal saves 39.0MiB (61%) of the plain 64.0MiB peak; its step time (+22%) is within the run-to-run spread "
         "(30%), so this machine cannot tell what it costs in time."),
        (None, _row("optimal", 25.0, 122.0, None),
         "optimal saves 39.0MiB (61%) of the plain 64.0MiB peak for +22% step time (one timing round: how much of that "
         "is noise is unknown)."),
        (3.0, _row("optimal", 25.0, 122.0, 4.0, budget_mib=20.0, equal=False),
         "optimal saves 39.0MiB (61%) of the plain 64.0MiB peak for +22% step time (122.0ms against 100.0ms), but its "
         "peak 25.0MiB is over the 20.0MiB budget; its gradients DIFFER from the plain model's."),
    ],
)  # fmt: skip
def test_the_verdict_claims_a_time_cost_only_beyond_the_spread(
    run: dict[str, Any], plain_spread: float | None, chosen: BenchRow, expected: str
) -> None:
    plan = Plan(strategy="optimal", blocks=run["plan"].blocks, ops=run["plan"].ops)
    chosen = replace(chosen, plan=plan)  # the row carries the plan it measured: the verdict finds it by that
    result = BenchResult(
        model="m", device="cpu", held_bytes=0, rounds=5, rows=(_row("none", 64.0, 100.0, plain_spread), chosen)
    )
    assert verdict(plan, result, run["profile"]) == expected


def test_markdown_links_the_charts_next_to_it(run: dict[str, Any], charts: dict[str, Path], tmp_path: Path) -> None:
    _, md_path = write_report(tmp_path, command="remat report gpt --budget 60%", charts=charts, **run)
    text = md_path.read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert sorted(links) == ["comparison.png", "heatmap.png", "timeline.png", "tradeoff.png"]
    for link in links:
        assert (tmp_path / link).is_file()
    assert "remat report gpt --budget 60%" in text
    assert run["plan"].describe() in text
    row = next(r for r in run["result"].rows if r.label == run["plan"].strategy)
    assert f"measured peak {format_bytes(row.peak_bytes)}" in text


def test_cli_report_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rr"
    sizes = [f"--set={k}={v}" for k, v in SIZES.items()]
    assert main(["report", "gpt", "--budget", BUDGET, "--out", str(out), "--rounds", "1", *sizes]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"report.html", "report.md", "timeline.png", "tradeoff.png", "comparison.png", "heatmap.png"} <= names
    text = (out / "report.html").read_text()
    assert len(decoded_pngs(text)) == 4
    assert f"remat report gpt --budget {BUDGET} --out {out} --rounds 1 --set n_layers=3" in text
    printed = capsys.readouterr().out
    assert "report.html" in printed and "timeline none: peak" in printed
    assert f"wrote {out / 'plan.json'}" in " ".join(printed.split()) and " saves " in printed
    assert (out / "plan.json").is_file()


def test_cli_report_with_an_infeasible_budget_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sizes = [f"--set={k}={v}" for k, v in SIZES.items()]
    assert main(["report", "gpt", "--budget", "1%", "--out", str(tmp_path / "rr"), *sizes]) == 1
    err = capsys.readouterr().err
    assert re.search(r"error: plan: budget .* is below the smallest feasible peak", err)
    assert not (tmp_path / "rr").exists()
