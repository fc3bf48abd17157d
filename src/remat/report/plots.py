"""Charts as PNG/SVG files: memory timelines, the trade-off, a per-block heatmap and a comparison.

matplotlib is an optional extra (``pip install 'remat[plot]'``), imported only inside these functions.
Figures are drawn on matplotlib's Agg canvas directly (``matplotlib.figure.Figure``, no pyplot), so
plotting needs no display, leaves the caller's pyplot state alone and never opens a window.
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from remat.errors import MissingExtraError, RematError
from remat.measure.compare import BenchResult, BenchRow
from remat.measure.timeline import Timeline
from remat.plan.frontier import Frontier
from remat.plan.types import SELECTED_OPS, Fate, Plan, part_kind, times_in_words
from remat.profile.types import Profile
from remat.report.data import ReportData, heatmap_plan
from remat.units import format_bytes, format_ms

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "plot_timelines",
    "plot_tradeoff",
    "plot_heatmap",
    "plot_comparison",
    "write_charts",
    "write_bench_plots",
    "block_decisions",
    "baseline_step_ms",
    "bytes_unit",
    "time_unit",
    "Chart",
    "CHARTS",
]

log = logging.getLogger(__name__)

_FORMATS = (".png", ".svg")
_KIND_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "recompute": "#C44E52"}
_PHASE_COLORS = {"forward": "#EEF2F8", "backward": "#FBF0E8"}
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p", "d", "8")


def _require_matplotlib() -> None:
    """Raises MissingExtraError unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise MissingExtraError(
            "report: plotting needs matplotlib, which is not installed; pip install 'remat[plot]'"
        ) from None


def _figure(width_in: float, height_in: float) -> Figure:
    """A new figure (inches) on the Agg canvas.

    Raises:
        MissingExtraError: If matplotlib is not installed.
    """
    _require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width_in, height_in), dpi=110, layout="constrained")


def _target(path: str | Path) -> Path:
    out = Path(path)
    if out.suffix.lower() not in _FORMATS:
        raise RematError(
            f"report: cannot write a chart to {str(out)!r}; give a file name ending in {' or '.join(_FORMATS)}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, facecolor="white")
    log.info("wrote %s", path)
    return path


def bytes_unit(largest_bytes: float) -> tuple[float, str]:
    """The divisor and unit name to show sizes up to ``largest_bytes`` (bytes): KiB, MiB or GiB."""
    if largest_bytes >= 2**30:
        return 2.0**30, "GiB"
    if largest_bytes >= 2**20:
        return 2.0**20, "MiB"
    return 2.0**10, "KiB"


def time_unit(largest_ms: float) -> tuple[float, str]:
    """The divisor and unit name to show durations up to ``largest_ms`` (milliseconds): ms or s."""
    return (1000.0, "s") if largest_ms >= 1000 else (1.0, "ms")


def plot_timelines(timelines: Sequence[Timeline], path: str | Path) -> Path:
    """Memory over one training step for several plans, overlaid.

    The upper panel draws each plan's allocated bytes against time, with its peak annotated and a
    dashed line where its backward starts; the lower panel has one lane per plan with the forward and
    backward phases shaded and every block's forward, backward and recompute drawn as a band.

    Args:
        timelines: From ``remat.timeline``, e.g. of the plain model and of a plan.
        path: The file to write, ``.png`` or ``.svg``.

    Returns:
        The path written.

    Raises:
        RematError: If ``timelines`` is empty or the file type is not PNG/SVG.
        MissingExtraError: If matplotlib is not installed.
    """
    if not timelines:
        raise RematError("report: plot_timelines needs at least one timeline; record one with remat.timeline(...)")
    out = _target(path)
    lanes = len(timelines)
    fig = _figure(11.0, 5.2 + 0.55 * lanes)
    grid = fig.add_gridspec(2, 1, height_ratios=[4.0, 0.45 + 0.5 * lanes])
    ax = fig.add_subplot(grid[0])
    band = fig.add_subplot(grid[1], sharex=ax)
    colors = [f"C{i}" for i in range(lanes)]
    top = max(max([*tl.bytes, tl.peak_bytes, 1]) for tl in timelines)
    b_div, b_unit = bytes_unit(top)
    end_ms = max(tl.duration_ms for tl in timelines)
    t_div, t_unit = time_unit(end_ms)
    for tl, color in zip(timelines, colors, strict=True):
        xs = [0.0, *(t / t_div for t in tl.t_ms), tl.duration_ms / t_div]
        level = [0, *tl.bytes]
        ys = [v / b_div for v in (*level, level[-1])]
        ax.plot(
            xs,
            ys,
            drawstyle="steps-post",
            color=color,
            linewidth=1.4,
            label=f"{tl.plan}: peak {format_bytes(tl.peak_bytes)}",
        )
        ax.fill_between(xs, ys, step="post", color=color, alpha=0.07)
        peak_y = (max(tl.bytes) if tl.bytes else 0) / b_div
        ax.plot([tl.peak_ms / t_div], [peak_y], marker="v", color=color, markersize=8, zorder=5)
        late = tl.peak_ms > 0.85 * end_ms  # a label right of a late peak would leave the axes: put it left
        ax.annotate(
            f"peak {format_bytes(tl.peak_bytes)}",
            xy=(tl.peak_ms / t_div, peak_y),
            xytext=(-6 if late else 6, 6),
            textcoords="offset points",
            ha="right" if late else "left",
            color=color,
            fontsize=9,
            fontweight="bold",
        )
        backward = next((p for p in tl.phases if p.name == "backward"), None)
        if backward is not None:
            ax.axvline(backward.start_ms / t_div, color=color, linestyle="--", linewidth=0.9, alpha=0.7)
    ax.set_ylim(0, top / b_div * (1.2 + 0.06 * lanes))  # headroom: the legend sits above the peaks
    ax.set_xlim(0, end_ms / t_div)
    held = timelines[0].held_bytes
    ax.set_ylabel(f"memory allocated above the\n{format_bytes(held)} held before the step ({b_unit})")
    ax.set_title(
        f"Memory over one training step ({timelines[0].device}); dashed lines: where each backward starts", loc="left"
    )
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=9, framealpha=0.9)
    ax.tick_params(labelbottom=False)
    _draw_lanes(band, timelines, t_div)
    band.set_xlabel(f"time since the step started ({t_unit})")
    return _save(fig, out)


def _draw_lanes(band: Axes, timelines: Sequence[Timeline], t_div: float) -> None:
    from matplotlib.patches import Patch

    lanes = len(timelines)
    for lane, tl in enumerate(timelines):
        y0 = lanes - 1 - lane  # the first timeline on top
        for phase in tl.phases:
            band.broken_barh(
                [(phase.start_ms / t_div, (phase.end_ms - phase.start_ms) / t_div)],
                (y0 + 0.05, 0.9),
                facecolors=_PHASE_COLORS.get(phase.name, "#F4F4F4"),
            )
        for iv in tl.intervals:
            # Forward and backward fill the upper part of the lane; recomputes (inside a backward) the lower.
            y, h = (y0 + 0.12, 0.36) if iv.kind == "recompute" else (y0 + 0.52, 0.36)
            band.broken_barh(
                [(iv.start_ms / t_div, max(iv.end_ms - iv.start_ms, 0.0) / t_div)],
                (y, h),
                facecolors=_KIND_COLORS.get(iv.kind, "grey"),
                edgecolors="white",
                linewidth=0.6,
            )
    band.set_ylim(0, lanes)
    band.set_yticks(
        [lanes - 1 - i + 0.5 for i in range(lanes)], [_shorten(tl.plan, 22) for tl in timelines], fontsize=9
    )
    band.grid(True, axis="x", alpha=0.3)
    handles = [Patch(color=c, label=f"block {k}") for k, c in _KIND_COLORS.items()]
    handles += [Patch(color=c, label=f"{k} phase") for k, c in _PHASE_COLORS.items()]
    band.figure.legend(handles=handles, loc="outside lower center", ncol=5, fontsize=8, frameon=False)


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def plot_tradeoff(result: BenchResult, frontier: Frontier, path: str | Path) -> Path:
    """Measured peak against measured step time for every strategy, with the optimal frontier.

    Each bench row is one marker (measured figures); the frontier is drawn as a step line through the
    optimal plans' *predicted* points: predicted peak against the baseline step plus the predicted
    recompute time, where the baseline step is the bench's plain row when it has one (timed in the same
    rounds as every strategy), else the frontier's. Points below and left of the line would beat the solver.

    Args:
        result: From ``remat.measure.compare.compare`` (``remat bench``).
        frontier: From ``remat.frontier(profile)`` on the same model.
        path: The file to write, ``.png`` or ``.svg``.

    Returns:
        The path written.

    Raises:
        RematError: If the result has no rows or the file type is not PNG/SVG.
        MissingExtraError: If matplotlib is not installed.
    """
    _check_rows(result)
    out = _target(path)
    fig = _figure(11.0, 6.0)
    ax = fig.add_subplot()
    base_ms = baseline_step_ms(result, frontier.baseline_step_ms)
    fx = [base_ms + p.extra_ms for p in frontier.points]
    fy = [p.peak_bytes for p in frontier.points]
    top_bytes = max([r.peak_bytes for r in result.rows] + fy + [1])
    b_div, b_unit = bytes_unit(top_bytes)
    t_div, t_unit = time_unit(max([r.step_ms for r in result.rows] + fx + [0.0]))
    if frontier.points:
        order = sorted(range(len(fx)), key=lambda i: fx[i])
        xs = [fx[i] / t_div for i in order]
        ys = [fy[i] / b_div for i in order]
        ax.plot(
            xs,
            ys,
            drawstyle="steps-post",
            color="black",
            linewidth=1.2,
            alpha=0.8,
            label="optimal frontier (predicted)",
            zorder=2,
        )
        ax.scatter(xs, ys, s=14, color="black", alpha=0.6, zorder=2)
    for i, r in enumerate(result.rows):
        ax.scatter(
            [r.step_ms / t_div],
            [r.peak_bytes / b_div],
            s=70,
            marker=_MARKERS[i % len(_MARKERS)],
            color=f"C{i % 10}",
            edgecolors="black" if r.solver is not None else "none",
            linewidths=1.2,
            label=f"{r.label}: {format_bytes(r.peak_bytes)}, {format_ms(r.step_ms)}",
            zorder=3,
        )
    ax.set_xlabel(f"measured step time, forward + backward ({t_unit})")
    ax.set_ylabel(f"measured peak memory above the\n{format_bytes(result.held_bytes)} held before the step ({b_unit})")
    ax.set_title(f"Memory against time: every strategy measured ({result.device})", loc="left")
    ax.set_ylim(0, top_bytes / b_div * 1.08)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _save(fig, out)


def baseline_step_ms(result: BenchResult, fallback_ms: float) -> float:
    """The plain step time to add predicted recompute times to, milliseconds: the bench's own plain row
    (timed in the same interleaved rounds as every plan) if its first row checkpoints nothing, else ``fallback_ms``."""
    if result.rows and result.rows[0].checkpointed == 0 and result.rows[0].depth == 0:
        return result.rows[0].step_ms
    return fallback_ms


def _check_rows(result: BenchResult) -> None:
    if not result.rows:
        raise RematError("report: the bench result has no rows; measure at least one plan with compare(...)")


def block_decisions(plan: Plan) -> list[str]:
    """What the plan does with each block, in the words of NOTE [ Plan vocabulary ] (``remat.plan.types``):
    ``"kept"``, ``"recomputed"``, ``"in a recomputed segment"`` (with ``", twice"`` ... when nested segments
    run it again), or ``"kept, attention recomputed"``, ``"kept, MLP recomputed"``, ``"kept, part recomputed"``,
    ``"kept, selected operations recomputed"`` (an op-level policy)."""
    return [label for label, _, _ in _decisions(plan)]


# The colour and the cell text of each decision (nested ones take _NESTED_COLORS and a count in the cell).
_DECISIONS = {
    "kept": ("#D9D9D9", "kept"),
    "recomputed": ("#C44E52", "recomp."),
    "in a recomputed segment": ("#D1762E", "in\nsegment"),
    "kept, attention recomputed": ("#B7791F", "attn\nrecomp."),
    "kept, MLP recomputed": ("#8C6BB1", "MLP\nrecomp."),
    "kept, part recomputed": ("#5F7F3F", "part\nrecomp."),
    f"kept, {SELECTED_OPS} recomputed": ("#3F7F8C", "ops\nrecomp."),
}
_NESTED_COLORS = ("#8E1B1F", "#5C0F12", "#3A080A")  # recomputed twice, three times, more


def _decisions(plan: Plan) -> list[tuple[str, str, str]]:
    """Per block: its label (``block_decisions``), its colour in the heatmap and its text in a cell."""
    out = []
    for block, f in zip(plan.blocks, plan.fates(), strict=True):
        if f.fate is Fate.PART:
            kind = part_kind(block, f)
            base = f"kept, {kind if kind in ('attention', 'MLP', SELECTED_OPS) else 'part'} recomputed"
        else:
            base = f.fate.value
        color, cell = _DECISIONS[base]
        if f.times > 1:
            out.append(
                (f"{base}, {times_in_words(f.times)}", _NESTED_COLORS[min(f.times - 2, 2)], f"{cell}\n{f.times}×")
            )
        else:
            out.append((base, color, cell))
    return out


def _cell_texts(values: Sequence[float]) -> list[str]:
    """The values with as many decimals as their largest needs (one format for a whole row)."""
    top = max([abs(v) for v in values] + [0.0])
    digits = 0 if top >= 100 else 1 if top >= 10 else 2
    return [f"{v:.{digits}f}" for v in values]


def _segment_edges(plan: Plan) -> list[int]:
    """Block indices where each top-level operation starts, and the end (a segment of several blocks
    is one checkpoint, so the heatmap draws its edges)."""
    fates = plan.fates()
    return [0, *(i for i in range(1, len(fates)) if fates[i].op != fates[i - 1].op), len(fates)]


def plot_heatmap(profile: Profile, plan: Plan, path: str | Path) -> Path:
    """Per-block heatmap: bytes each block saves for backward, its recompute time, and the plan's decision.

    Args:
        profile: From ``remat.profile``.
        plan: A plan for the profile's blocks (``remat.plan``).
        path: The file to write, ``.png`` or ``.svg``.

    Returns:
        The path written.

    Raises:
        RematError: If the plan has a different number of blocks than the profile, or for a bad file type.
        MissingExtraError: If matplotlib is not installed.
    """
    n = len(profile.blocks)
    if len(plan.blocks) != n:
        raise RematError(
            f"report: the plan ({plan.strategy}) has {len(plan.blocks)} blocks but the profile has {n}; "
            "plan on this profile (remat.plan(profile, ...))"
        )
    out = _target(path)
    _require_matplotlib()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    saved = [bp.saved_bytes for bp in profile.block_profiles]
    # What checkpointing the block on its own adds to a step, as the planner charges it (NOTE [ Chain cost
    # model ]): its measured no-save forward under a checkpoint, less the ops after its last save (early
    # stop); the plain forward time only for profiles without that measurement.
    recompute_ms = [
        max(0.0, bp.ckpt_fwd_ms - bp.stop_ms) + profile.ckpt_call_ms if bp.ckpt_fwd_ms > 0 else bp.fwd_ms
        for bp in profile.block_profiles
    ]
    decisions = _decisions(plan)
    b_div, b_unit = bytes_unit(max(saved + [1]))
    t_div, t_unit = time_unit(max(recompute_ms + [0.0]))
    width = min(22.0, max(8.0, 2.5 + 0.62 * n))
    fig = _figure(width, 4.2)
    axes = fig.subplots(3, 1, sharex=True)
    rows: list[tuple[str, list[float], str, list[str]]] = [
        (
            f"saved for\nbackward ({b_unit})",
            [s / b_div for s in saved],
            "Blues",
            _cell_texts([s / b_div for s in saved]),
        ),
        (
            f"recompute\ntime ({t_unit})",
            [t / t_div for t in recompute_ms],
            "Oranges",
            _cell_texts([t / t_div for t in recompute_ms]),
        ),
    ]
    annotate = n <= 40
    fontsize = 8 if n <= 16 else 6.5
    for ax, (label, values, cmap, texts) in zip(axes, rows, strict=False):
        hi = max(values + [1e-12])
        ax.imshow([values], cmap=cmap, vmin=0, vmax=hi * 1.15, aspect="auto")
        ax.set_yticks([0], [label], fontsize=9)
        if annotate:
            for k, (v, txt) in enumerate(zip(values, texts, strict=True)):
                ax.text(
                    k, 0, txt, ha="center", va="center", fontsize=fontsize, color="white" if v > 0.65 * hi else "black"
                )
    kinds = list(dict.fromkeys((label, color) for label, color, _ in decisions))  # in order of first use
    ax = axes[2]
    index = {label: i for i, (label, _) in enumerate(kinds)}
    palette = ListedColormap([color for _, color in kinds])
    ax.imshow(
        [[index[label] for label, _, _ in decisions]], cmap=palette, vmin=-0.5, vmax=len(kinds) - 0.5, aspect="auto"
    )
    ax.set_yticks([0], ["the plan"], fontsize=9)
    if annotate:
        for k, (label, _, cell) in enumerate(decisions):
            ax.text(
                k, 0, cell, ha="center", va="center", fontsize=fontsize, color="black" if label == "kept" else "white"
            )
    handles = [Patch(facecolor=color, edgecolor="#999999", label=label) for label, color in kinds]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    for edge in _segment_edges(plan)[1:-1]:
        ax.axvline(edge - 0.5, color="black", linewidth=2.5)
    names = [b.name for b in profile.blocks]
    ax.set_xticks(range(n), names, rotation=45 if n > 6 else 0, ha="right" if n > 6 else "center", fontsize=8)
    for a in axes:
        a.set_xticks([k + 0.5 for k in range(n - 1)], minor=True)
        a.grid(True, which="minor", color="white", linewidth=1.5)
        a.tick_params(which="minor", length=0)
    ax.set_xlabel("block, in forward order (thick lines: where each checkpoint or kept block starts and ends)")
    peak = (
        f"; predicted peak {format_bytes(plan.predicted_peak_bytes)}" if plan.predicted_peak_bytes is not None else ""
    )
    axes[0].set_title(
        textwrap.fill(f"{plan.strategy}: {plan.headline()}{peak}", width=int(width * 11)), loc="left", fontsize=10
    )
    return _save(fig, out)


def plot_comparison(result: BenchResult, path: str | Path) -> Path:
    """Bars of measured peak memory and step time per strategy, with the baseline (first row) marked.

    Args:
        result: From ``remat.measure.compare.compare`` (``remat bench``).
        path: The file to write, ``.png`` or ``.svg``.

    Returns:
        The path written.

    Raises:
        RematError: If the result has no rows or the file type is not PNG/SVG.
        MissingExtraError: If matplotlib is not installed.
    """
    _check_rows(result)
    out = _target(path)
    rows = result.rows
    fig = _figure(12.0, 1.6 + 0.36 * len(rows))
    mem_ax, time_ax = fig.subplots(1, 2, sharey=True)
    b_div, b_unit = bytes_unit(max(r.peak_bytes for r in rows))
    t_div, t_unit = time_unit(max(r.step_ms for r in rows))
    ys = list(range(len(rows)))
    colors = [_row_color(i, r) for i, r in enumerate(rows)]
    base = rows[0]
    for ax, values, div, baseline, fmt in (
        (mem_ax, [r.peak_bytes for r in rows], b_div, base.peak_bytes, format_bytes),
        (time_ax, [r.step_ms for r in rows], t_div, base.step_ms, format_ms),
    ):
        scaled = [v / div for v in values]
        ax.barh(ys, scaled, color=colors, height=0.7)
        ax.axvline(baseline / div, color="black", linestyle="--", linewidth=1.0, label=f"baseline ({base.label})")
        top = max(scaled + [1e-12])
        for y, v, raw in zip(ys, scaled, values, strict=True):
            ax.text(v + top * 0.01, y, fmt(raw), va="center", fontsize=8)
        ax.set_xlim(0, top * 1.22)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    mem_ax.set_yticks(ys, [r.label for r in rows], fontsize=9)
    mem_ax.invert_yaxis()
    mem_ax.set_xlabel(f"measured peak memory above the {format_bytes(result.held_bytes)} held ({b_unit})")
    time_ax.set_xlabel(f"measured step time, median of {result.rounds} rounds ({t_unit})")
    mem_ax.set_title("Peak memory (lower is better)", loc="left")
    time_ax.set_title("Step time (lower is better)", loc="left")
    return _save(fig, out)


def _row_color(i: int, row: BenchRow) -> str:
    if i == 0:
        return "#8C8C8C"
    if row.solver is not None:
        return "#55A868"
    if row.budget_bytes is not None and row.peak_bytes > row.budget_bytes:
        return "#C44E52"
    return "#4C72B0"


def _always(_data: ReportData) -> bool:
    return True


@dataclass(frozen=True)
class Chart:
    """One chart of a report: how to draw it from the report's values, and what to call it.

    Attributes:
        title: Its heading in the HTML and Markdown documents.
        caption: What it shows, below it in the HTML document.
        draw: ``draw(data, path)`` writes the chart to ``path`` (``.png`` or ``.svg``) and returns the path.
        ready: Whether ``data`` holds what the chart draws (the timeline chart needs timelines).
    """

    title: str
    caption: str
    draw: Callable[[ReportData, Path], Path]
    ready: Callable[[ReportData], bool] = _always


CHARTS: dict[str, Chart] = {
    "timeline": Chart(
        "Memory over one training step",
        "Allocated memory above what is held before the step (parameters, gradients, inputs), for the plain "
        "model, recompute-everything and the chosen plan. Bands below: each block's forward, backward and "
        "recomputation; shading: forward and backward phases.",
        lambda data, path: plot_timelines(data.timelines, path),
        ready=lambda data: bool(data.timelines),
    ),
    "tradeoff": Chart(
        "Peak memory against step time",
        "Every strategy as measured (one marker each) and the optimal frontier predicted by the solver "
        "(peak against the plain step time plus the predicted recompute time). The markers are measured and the "
        "line predicted: markers fall on either side of it by as much as the run-to-run spread (the bench's "
        "spread column).",
        lambda data, path: plot_tradeoff(data.result, data.frontier, path),
    ),
    "comparison": Chart(
        "Strategies side by side",
        "Measured peak memory and median step time of every strategy; dashed: the plain model.",
        lambda data, path: plot_comparison(data.result, path),
    ),
    "heatmap": Chart(
        "Per block: saved bytes, recompute time, decision",
        "What each block saves for its backward, what recomputing it costs, and what the chosen plan does with it.",
        lambda data, path: plot_heatmap(data.profile, data.plan, path),
    ),
}
"""Every chart of a report by name, in the order the documents show them; :func:`write_charts` writes
each one whose values the report has to ``<name>.png``, and the HTML and Markdown take their titles here."""


def write_charts(directory: str | Path, data: ReportData) -> dict[str, Path]:
    """Write every chart of :data:`CHARTS` that ``data`` has the values for as ``<name>.png`` into
    ``directory`` (created if missing).

    Args:
        directory: Where to write.
        data: The report's values (the timeline chart is left out when it has no timelines).

    Returns:
        Each chart's name and path, in the order of :data:`CHARTS`.

    Raises:
        MissingExtraError: If matplotlib is not installed.
    """
    _require_matplotlib()
    d = Path(directory)
    return {name: chart.draw(data, d / f"{name}.png") for name, chart in CHARTS.items() if chart.ready(data)}


def write_bench_plots(
    result: BenchResult, profile: Profile, directory: str | Path, *, frontier: Frontier, plan: Plan | None = None
) -> list[Path]:
    """The charts of ``remat bench --plots DIR``: every chart of :data:`CHARTS` that needs no timeline
    (trade-off, comparison and a per-block heatmap).

    Args:
        result: The bench.
        profile: The profile the bench's plans were made from.
        directory: Where to write ``tradeoff.png``, ``comparison.png`` and ``heatmap.png`` (created if missing).
        frontier: From ``remat.frontier(profile)``.
        plan: The plan the heatmap shows; default: the one :func:`remat.report.data.heatmap_plan` picks
            from the bench (the optimal plan whose budget is the tightest its measured peak fits).

    Returns:
        The paths written.

    Raises:
        RematError: If no plan is given and the bench has no plan of the optimal solver.
        MissingExtraError: If matplotlib is not installed.
    """
    _require_matplotlib()
    shown = plan or heatmap_plan(result)
    if shown is None:
        raise RematError(
            "report: the bench has no optimal plan for the heatmap; bench with a --budget, or give "
            "plan=remat.plan(profile, strategy=remat.full())"
        )
    return list(write_charts(directory, ReportData(profile, shown, result, frontier)).values())
