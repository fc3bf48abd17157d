"""The charts: every file decodes and is not blank; units switch; a missing matplotlib is a clear error."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import remat
from remat.core.ops import Keep, Recompute, RecomputeSub
from remat.errors import MissingExtraError, RematError
from remat.models import workload
from remat.plan.types import Plan
from remat.report import plot_comparison, plot_heatmap, plot_timelines, plot_tradeoff, write_bench_plots
from remat.report.plots import block_decisions, bytes_unit, time_unit


def assert_png_has_content(path: Path) -> None:
    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))
    rgb = np.asarray(pixels)[..., :3]
    assert rgb.ndim == 3 and rgb.shape[0] > 100 and rgb.shape[1] > 100
    assert float(rgb.std()) > 0.01, "a uniform image"
    assert float((rgb < 0.95).mean()) > 0.01, "almost all white"


def test_timeline_chart(run: dict[str, Any], tmp_path: Path) -> None:
    out = plot_timelines(run["timelines"], tmp_path / "timeline.png")
    assert out == tmp_path / "timeline.png"
    assert_png_has_content(out)


def test_tradeoff_chart(run: dict[str, Any], tmp_path: Path) -> None:
    assert_png_has_content(plot_tradeoff(run["result"], run["frontier"], tmp_path / "tradeoff.png"))


def test_heatmap_chart(run: dict[str, Any], tmp_path: Path) -> None:
    assert_png_has_content(plot_heatmap(run["profile"], run["plan"], tmp_path / "heatmap.png"))


def test_comparison_chart(run: dict[str, Any], tmp_path: Path) -> None:
    assert_png_has_content(plot_comparison(run["result"], tmp_path / "comparison.png"))


def test_svg_is_written_too(run: dict[str, Any], tmp_path: Path) -> None:
    out = plot_comparison(run["result"], tmp_path / "sub" / "comparison.svg")
    text = out.read_text()
    assert "<svg" in text and "none" in text


def test_other_file_types_are_refused(run: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(RematError, match=r"cannot write a chart to .*chart\.jpg.*ending in \.png or \.svg"):
        plot_comparison(run["result"], tmp_path / "chart.jpg")


def test_no_timelines_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RematError, match=r"plot_timelines needs at least one timeline"):
        plot_timelines([], tmp_path / "t.png")


def test_heatmap_of_a_plan_for_other_blocks_is_refused(run: dict[str, Any], tmp_path: Path) -> None:
    plan = run["plan"]
    short = Plan(strategy="short", blocks=plan.blocks[:1], ops=(Keep(0),))
    with pytest.raises(RematError, match=r"plan \(short\) has 1 blocks but the profile has 3"):
        plot_heatmap(run["profile"], short, tmp_path / "h.png")


def test_bench_plots(run: dict[str, Any], tmp_path: Path) -> None:
    paths = write_bench_plots(run["result"], run["profile"], tmp_path / "plots", frontier=run["frontier"])
    assert [p.name for p in paths] == ["tradeoff.png", "comparison.png", "heatmap.png"]
    for p in paths:
        assert_png_has_content(p)


def test_missing_matplotlib_is_a_clear_error(
    run: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(MissingExtraError, match=r"needs matplotlib.*pip install 'remat\[plot\]'"):
        plot_comparison(run["result"], tmp_path / "c.png")
    with pytest.raises(MissingExtraError, match=r"pip install 'remat\[plot\]'"):
        plot_heatmap(run["profile"], run["plan"], tmp_path / "h.png")
    with pytest.raises(MissingExtraError, match=r"pip install 'remat\[plot\]'"):
        write_bench_plots(run["result"], run["profile"], tmp_path, frontier=run["frontier"])
    assert not list(tmp_path.glob("*.png"))


def test_decisions_show_nesting_and_sub_modules() -> None:
    blocks = remat.blocks(workload("gpt", n_layers=4, d_model=32, n_heads=2, seq_len=8, batch=1, vocab_size=32).model)
    ops = (
        Recompute(0, 3, (Keep(0), Recompute(1, 2, (Keep(1),)), Keep(2))),
        RecomputeSub(3, blocks[3].attention_fqns),
    )
    plan = Plan(strategy="mixed", blocks=blocks, ops=ops)
    # The words of NOTE [ Plan vocabulary ]: block 1 runs again inside the segment's replay, so twice.
    assert block_decisions(plan) == [
        "in a recomputed segment",
        "in a recomputed segment, twice",
        "in a recomputed segment",
        "kept, attention recomputed",
    ]
    single = Plan(
        strategy="mixed",
        blocks=blocks,
        ops=(Recompute(0, 1, (Keep(0),)), Keep(1), RecomputeSub(2, blocks[2].ffn_fqns), Keep(3)),
    )
    assert block_decisions(single) == ["recomputed", "kept", "kept, MLP recomputed", "kept"]


@pytest.mark.parametrize(
    ("largest", "unit"), [(512, "KiB"), (3 * 2**20, "MiB"), (2**30 - 1, "MiB"), (5 * 2**30, "GiB")]
)
def test_bytes_unit(largest: int, unit: str) -> None:
    div, name = bytes_unit(largest)
    assert name == unit and div == {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_time_unit() -> None:
    assert time_unit(999.0) == (1.0, "ms")
    assert time_unit(2500.0) == (1000.0, "s")
