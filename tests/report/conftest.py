"""Shared by the report tests: the values of one small GPT's report, read from JSON fixtures.

The report draws values and never measures (NOTE [ Report files ] in ``remat.report.data``), so its
tests read what ``remat.report.collect`` measured once, written by ``tests/report/make_fixtures.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from remat.report import ReportData, write_charts

SIZES = dict(n_layers=3, d_model=32, n_heads=2, seq_len=16, batch=2, vocab_size=64)
BUDGET = (
    "90%"  # the smallest feasible peak of this tiny GPT is about 80% of its plain peak (gradients made in the backward)
)
FIXTURES = Path(__file__).parent / "fixtures"
"""profile.json, plan.json, bench.json, frontier.json and timeline-<n>.json of a small GPT at ``BUDGET``."""


@pytest.fixture(scope="session")
def data() -> ReportData:
    """Everything the charts and the report draw, for a small GPT (one timing round), read from JSON."""
    return ReportData.read(FIXTURES)


@pytest.fixture(scope="session")
def run(data: ReportData) -> dict[str, Any]:
    """The same values by the names of ``write_report``'s arguments."""
    return {
        "profile": data.profile,
        "plan": data.plan,
        "result": data.result,
        "frontier": data.frontier,
        "timelines": data.timelines,
    }


@pytest.fixture(scope="session")
def drawn(data: ReportData, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every chart of the fixtures' report, drawn once per session (the chart tests draw their own)."""
    return write_charts(tmp_path_factory.mktemp("charts"), data)


@pytest.fixture
def charts(drawn: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    """The drawn charts, copied into the test's ``tmp_path``, where the Markdown links them."""
    return {name: Path(shutil.copy(path, tmp_path / path.name)) for name, path in drawn.items()}
