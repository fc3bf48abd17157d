"""The HTML report and its Markdown summary, and ``remat report`` end to end on a small GPT."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from remat.cli.main import main
from remat.report import write_report
from remat.units import format_bytes

from .conftest import SIZES

IMG = re.compile(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def decoded_pngs(text: str) -> list[np.ndarray]:
    import matplotlib.image

    return [np.asarray(matplotlib.image.imread(io.BytesIO(base64.b64decode(data)), format="png")) for data in IMG.findall(text)]


def test_report_embeds_every_chart_and_the_tables(run: dict[str, Any], tmp_path: Path) -> None:
    command = "remat report gpt --budget 60% --set n_layers=3"
    html_path, md_path = write_report(tmp_path, command=command, description="tiny <GPT> & co", **run)
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


def test_markdown_links_the_charts_next_to_it(run: dict[str, Any], tmp_path: Path) -> None:
    _, md_path = write_report(tmp_path, command="remat report gpt --budget 60%", **run)
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
    assert main(["report", "gpt", "--budget", "60%", "--out", str(out), "--rounds", "1", *sizes]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"report.html", "report.md", "timeline.png", "tradeoff.png", "comparison.png", "heatmap.png"} <= names
    text = (out / "report.html").read_text()
    assert len(decoded_pngs(text)) == 4
    assert f"remat report gpt --budget 60% --out {out} --rounds 1 --set n_layers=3" in text
    printed = capsys.readouterr().out
    assert "report.html" in printed and "timeline none: peak" in printed


def test_cli_report_with_an_infeasible_budget_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sizes = [f"--set={k}={v}" for k, v in SIZES.items()]
    assert main(["report", "gpt", "--budget", "1%", "--out", str(tmp_path / "rr"), *sizes]) == 1
    err = capsys.readouterr().err
    assert re.search(r"error: plan: budget .* is below the smallest feasible peak", err)
    assert not (tmp_path / "rr").exists()
