"""The report of ``remat report``: one self-contained HTML file, a Markdown summary and the plan's JSON.

The HTML carries its CSS inline and every chart as a base64 PNG, so it can be mailed or attached to
an issue as one file; the Markdown links the PNGs written next to it; ``plan.json`` is the chosen plan,
for ``remat measure --plan`` and ``remat.apply``. Every piece of text that comes from the model, the
plans or the command line is escaped. Both documents open with the same one-sentence verdict
(:func:`verdict`) and say what the plan does in the words of NOTE [ Plan vocabulary ].

Everything here draws from values (:class:`remat.report.data.ReportData`): nothing measures or plans.
:func:`build` writes a whole report directory, the JSON values included (NOTE [ Report files ]).
"""

from __future__ import annotations

import base64
import html
import logging
import platform
import shlex
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import torch

from remat._json import write_atomic
from remat.core.ops import validate_ops
from remat.errors import RematError
from remat.measure.compare import BenchResult, BenchRow, separable
from remat.measure.timeline import Timeline
from remat.plan.frontier import Frontier
from remat.plan.types import LEGEND, Fate, Plan, ops_from_text
from remat.profile.types import Profile
from remat.report.data import PLAN_JSON, ReportData
from remat.report.plots import CHARTS, baseline_step_ms, write_charts
from remat.report.tables import (
    BENCH_HEADERS,
    PROFILE_HEADERS,
    RECOMPUTED_NOTE,
    bench_rows,
    budget_verdicts,
    noise_warning,
    profile_rows,
    ratio_pct,
)
from remat.units import format_bytes, format_ms

__all__ = ["build", "Written", "write_report", "verdict", "REPORT_HTML", "REPORT_MD", "REPORT_PLAN"]

log = logging.getLogger(__name__)

REPORT_HTML = "report.html"
REPORT_MD = "report.md"
REPORT_PLAN = PLAN_JSON

_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 2rem auto;
       max-width: 1280px; padding: 0 1.5rem; color: #1d1d1f; line-height: 1.45; }
h1 { font-size: 1.7rem; margin-bottom: 0.2rem; } h2 { font-size: 1.25rem; margin-top: 2.2rem;
     border-bottom: 1px solid #ddd; padding-bottom: 0.3rem; }
.sub { color: #666; margin-top: 0; }
pre.cmd { background: #1e1e1e; color: #f0f0f0; padding: 0.8rem 1rem; border-radius: 6px; overflow-x: auto; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.88rem; }
th, td { border: 1px solid #d8d8d8; padding: 0.28rem 0.6rem; }
th { background: #f3f4f6; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.chosen td { background: #eaf6ec; font-weight: 600; }
.cards { display: flex; flex-wrap: wrap; gap: 0.8rem; margin: 1rem 0; }
.card { flex: 1 1 0; border: 1px solid #ddd; border-radius: 8px; padding: 0.7rem 1rem; min-width: 150px; background: #fafafa; }
.card .v { font-size: 1.35rem; font-weight: 600; } .card .k { color: #666; font-size: 0.82rem; }
figure { margin: 1.2rem 0 2rem 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.88rem; margin-top: 0.3rem; }
p.verdict { font-size: 1.15rem; background: #f3f7fb; border-left: 4px solid #4c72b0; padding: 0.6rem 0.9rem; }
table.plan td.blocks { font-family: ui-monospace, Menlo, Consolas, monospace; white-space: nowrap; }
.keep { color: #2e7d32; } .rec { color: #c62828; } .seg { color: #b8501a; } .subop { color: #8a5a00; }
p.legend { color: #555; font-size: 0.88rem; }
.ok { color: #2e7d32; } .bad { color: #c62828; font-weight: 600; }
code { background: #f3f4f6; padding: 0 0.25rem; border-radius: 3px; }
pre.cmd code { background: none; color: inherit; padding: 0; }
table.kv th { width: 14rem; font-weight: 500; }
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    numeric_from: int = 1,
    text: Collection[int] = (),
    highlight: int | None = None,
) -> str:
    """A table; columns from ``numeric_from`` on are right-aligned, except those in ``text``."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cells = "".join(
            f'<td class="num">{_e(c)}</td>' if j >= numeric_from and j not in text else f"<td>{_e(c)}</td>"
            for j, c in enumerate(row)
        )
        cls = ' class="chosen"' if i == highlight else ""
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _kv_table(rows: Sequence[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv"><tbody>{body}</tbody></table>'


_FATE_CLASSES = {Fate.KEPT: "keep", Fate.RECOMPUTED: "rec", Fate.SEGMENT: "seg", Fate.PART: "subop"}


def _plan_html(plan: Plan) -> str:
    """The plan in words (``Plan.lines``): one row per run of blocks, what happens inside a segment indented."""
    rows = "".join(
        f'<tr><td class="blocks" style="padding-left: {0.6 + 1.5 * line.depth:.1f}rem">{_e(plan.span(line.blocks))}</td>'
        f'<td class="{_FATE_CLASSES[line.fate]}">{_e(line.what)}</td></tr>'
        for line in plan.lines()
    )
    return f'<table class="plan"><thead><tr><th>blocks</th><th>what happens to them in a step</th></tr></thead><tbody>{rows}</tbody></table>'


def _plan_md(plan: Plan) -> list[str]:
    """The plan in words (``Plan.lines``) as a nested Markdown list."""
    return [f"{'  ' * line.depth}- `{plan.span(line.blocks)}`: {line.what}" for line in plan.lines()]


def _reuse(command: str, directory: Path) -> tuple[str, str]:
    """How to reuse the written plan: the ``remat measure`` command line (the model, ``--set`` and loop
    flags ``--grads`` / ``--optimizer`` of ``command`` when it is a ``remat report`` line) and the Python call."""
    path = str(directory / REPORT_PLAN)
    model = ["MODEL"]
    loop: list[str] = []
    try:
        words = shlex.split(command)
    except ValueError:
        words = []
    if words[:2] == ["remat", "report"] and len(words) > 2 and not words[2].startswith("-"):
        model = [words[2]] + [
            w for i, w in enumerate(words) if w.startswith("--set") or (i and words[i - 1] == "--set")
        ]
        loop = [
            w
            for i, w in enumerate(words)
            if w.startswith(("--grads", "--optimizer")) or (i and words[i - 1] in ("--grads", "--optimizer"))
        ]
    return (
        shlex.join(["remat", "measure", *model, "--plan", path, *loop]),
        f"import remat; from pathlib import Path; from remat.plan import Plan; "
        f"remat.apply(model, Plan.from_json(Path({path!r}).read_text()))",
    )


def _is_plain(row: BenchRow) -> bool:
    return row.checkpointed == 0 and row.depth == 0


def verdict(plan: Plan, result: BenchResult, profile: Profile) -> str:
    """One sentence on the plan: the memory it saves and the step time it costs, measured in the bench
    against its plain row, claiming a time cost only as far as the run-to-run spread supports it
    (NOTE [ Timing noise ] in ``remat.measure.compare``); predicted figures when the bench lacks the plan.

    Args:
        plan: The chosen plan.
        result: The bench, its first row the plain model.
        profile: The profile the plan was made from (for predictions).

    Returns:
        E.g. ``"optimal @ 40% saves 39.1MiB (61%) of the plain 64.9MiB peak for +22% step time (137.2ms against 112.5ms)."``
    """
    row = result.row_of(plan)
    base = result.rows[0] if result.rows and _is_plain(result.rows[0]) else None
    if row is None or base is None or base.peak_bytes <= 0:
        if plan.predicted_peak_bytes is None or plan.predicted_extra_ms is None or profile.peak_bytes <= 0:
            return f"{plan.strategy} was not measured; see the bench below."
        saved = profile.peak_bytes - plan.predicted_peak_bytes
        base_ms = baseline_step_ms(result, profile.step_ms)
        extra = f"{plan.predicted_extra_ms / base_ms:+.0%}" if base_ms > 0 else f"+{format_ms(plan.predicted_extra_ms)}"
        return (
            f"{plan.strategy} is predicted to save {format_bytes(saved)} ({saved / profile.peak_bytes:.0%}) of the plain "
            f"{format_bytes(profile.peak_bytes)} peak for {extra} step time (not measured)."
        )
    if row is base:
        return f"{plan.strategy} is the plain model: it recomputes nothing, saves nothing and costs nothing."
    saved = base.peak_bytes - row.peak_bytes
    text = f"{plan.strategy} saves {format_bytes(saved)} ({row.saved_pct:.0f}%) of the plain {format_bytes(base.peak_bytes)} peak"
    if row.spread_pct is None or base.spread_pct is None:
        text += f" for {row.overhead_pct:+.0f}% step time (one timing round: how much of that is noise is unknown)"
    elif separable(row, base):
        text += f" for {row.overhead_pct:+.0f}% step time ({format_ms(row.step_ms)} against {format_ms(base.step_ms)})"
    else:
        spread = max(row.spread_pct, base.spread_pct)
        text += (
            f"; its step time ({row.overhead_pct:+.0f}%) is within the run-to-run spread ({spread:.0f}%), "
            "so this machine cannot tell what it costs in time"
        )
    budget = row.budget_bytes if row.budget_bytes is not None else plan.budget_bytes
    if budget is not None and row.peak_bytes > budget:
        text += f", but its peak {format_bytes(row.peak_bytes)} is over the {format_bytes(budget)} budget"
    if not row.grads_equal:
        text += "; its gradients DIFFER from the plain model's"
    return text + "."


def _frontier_rows(
    frontier: Frontier, plan: Plan, profile: Profile, base_ms: float
) -> tuple[list[list[str]], int | None]:
    """One row per optimal point, by rising peak: predicted peak, its share of the plain peak, extra time,
    and what it recomputes; the chosen plan is among them (added when the frontier's budgets missed it).

    Returns:
        The rows and the index of the chosen plan's row (``None`` without predictions for it).
    """
    points = [(p.peak_bytes, p.extra_ms, p.ops) for p in frontier.points]
    chosen = plan.describe()
    if (
        plan.predicted_peak_bytes is not None
        and plan.predicted_extra_ms is not None
        and chosen not in {p[2] for p in points}
    ):
        points.append((plan.predicted_peak_bytes, plan.predicted_extra_ms, chosen))
    points.sort(key=lambda p: (p[0], p[1]))
    rows = []
    for peak_bytes, extra_ms, text in points:
        try:
            ops = ops_from_text(text)
            validate_ops(ops, len(profile.blocks))
            words = Plan(strategy="optimal", blocks=profile.blocks, ops=ops).recomputes()
        except RematError:  # a frontier of other blocks: its compact form is all there is
            words = f"{text} ({LEGEND})"
        share = f"{peak_bytes / profile.peak_bytes:.0%}" if profile.peak_bytes > 0 else "-"
        extra = f"+{format_ms(extra_ms)}" + (f" (+{extra_ms / base_ms:.0%})" if base_ms > 0 else "")
        rows.append([format_bytes(peak_bytes), share, extra, ("the chosen plan: " if text == chosen else "") + words])
    return rows, next((i for i, (_, _, text) in enumerate(points) if text == chosen), None)


def _card(value: str, key: str) -> str:
    return f'<div class="card"><div class="v">{_e(value)}</div><div class="k">{_e(key)}</div></div>'


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{_e(path.stem)}" src="data:image/png;base64,{data}">'


def _key_figures(profile: Profile, plan: Plan, row: BenchRow | None, base_ms: float) -> list[tuple[str, str]]:
    """(value, what) pairs: the headline numbers of the report."""
    out = [
        (format_bytes(profile.peak_bytes), "plain peak (above held memory)"),
        (format_ms(base_ms), "plain step time"),
    ]
    if plan.budget_bytes is not None:
        out.append((format_bytes(plan.budget_bytes), "budget"))
    if plan.predicted_peak_bytes is not None:
        out.append((format_bytes(plan.predicted_peak_bytes), f"{plan.strategy}: predicted peak"))
    if row is not None:
        out.append((format_bytes(row.peak_bytes), f"{plan.strategy}: measured peak ({row.saved_pct:.0f}% saved)"))
        out.append((format_ms(row.step_ms), f"{plan.strategy}: measured step ({row.overhead_pct:+.0f}%)"))
    return out


def write_report(
    directory: str | Path,
    *,
    profile: Profile,
    plan: Plan,
    result: BenchResult,
    frontier: Frontier,
    timelines: Sequence[Timeline],
    command: str,
    description: str = "",
    charts: Mapping[str, Path] | None = None,
) -> tuple[Path, Path]:
    """Write ``report.html`` (self-contained), ``report.md`` (links the PNGs next to it) and ``plan.json``.

    Args:
        directory: Where to write (created if missing); the charts go there too when not given.
        profile: From ``remat.profile``.
        plan: The chosen plan (``remat.plan`` at the budget).
        result: The bench of every strategy (``remat.measure.compare.compare``), the plain model first.
        frontier: From ``remat.frontier(profile)``.
        timelines: From ``remat.timeline``, e.g. of the plain model, ``full`` and the plan.
        command: The command line that produced the report, shown verbatim (escaped).
        description: One line describing the workload (default: the profile's model class).
        charts: Already written charts by name (``"timeline"``, ``"tradeoff"``, ``"comparison"``,
            ``"heatmap"``) and PNG path; default: write them with :func:`remat.report.plots.write_charts`.

    Returns:
        The paths of the HTML file and of the Markdown file; the plan is written next to them as
        ``plan.json`` (``REPORT_PLAN``).

    Raises:
        MissingExtraError: If the charts must be drawn and matplotlib is not installed.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    data = ReportData(profile, plan, result, frontier, tuple(timelines))
    if charts is None:
        charts = write_charts(d, data)
    desc = description or profile.model
    plan_path = d / REPORT_PLAN
    write_atomic(plan_path, plan.to_json())
    html_path = d / REPORT_HTML
    write_atomic(html_path, _html(d, data, command, desc, charts))
    md_path = d / REPORT_MD
    write_atomic(md_path, _markdown(d, data, command, desc, charts))
    log.info("wrote %s, %s and %s", html_path, md_path, plan_path)
    return html_path, md_path


class Written(NamedTuple):
    """The files :func:`build` wrote.

    Attributes:
        html: ``report.html``.
        markdown: ``report.md``.
        charts: Each chart's name and PNG path (:data:`remat.report.plots.CHARTS`).
        values: The JSON files of the values the report was drawn from (NOTE [ Report files ]).
    """

    html: Path
    markdown: Path
    charts: dict[str, Path]
    values: list[Path]


def build(directory: str | Path, data: ReportData, *, command: str, description: str = "") -> Written:
    """Write a whole report from its values: the charts, ``report.html``, ``report.md``, and the JSON
    files of the values (NOTE [ Report files ]), from which ``remat report --from DIR`` draws it again.

    Args:
        directory: Where to write (created if missing).
        data: The values (:class:`remat.report.data.ReportData`; ``remat.report.collect`` measures them).
        command: The command line that produced the report, shown verbatim (escaped).
        description: One line describing the workload (default: the profile's model class).

    Returns:
        The paths written.

    Raises:
        MissingExtraError: If matplotlib is not installed.
    """
    charts = write_charts(directory, data)  # first: without matplotlib, nothing is written
    values = data.write(directory)
    html_path, md_path = write_report(
        directory,
        profile=data.profile,
        plan=data.plan,
        result=data.result,
        frontier=data.frontier,
        timelines=data.timelines,
        command=command,
        description=description,
        charts=charts,
    )
    return Written(html_path, md_path, charts, values)


def _html(d: Path, data: ReportData, command: str, desc: str, charts: Mapping[str, Path]) -> str:
    """The HTML document (see :func:`write_report`)."""
    from remat._version import __version__

    profile, plan, result, frontier, timelines = data.profile, data.plan, data.result, data.frontier, data.timelines
    row = result.row_of(plan)
    base_ms = baseline_step_ms(result, profile.step_ms)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    warning = noise_warning(result)
    measure_cmd, apply_call = _reuse(command, d)
    env = f"remat {__version__}, torch {torch.__version__}, Python {platform.python_version()}, {profile.device}"

    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>remat report: {_e(desc)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>remat report: {_e(desc)}</h1>",
        f'<p class="sub">{_e(stamp)} &middot; {_e(env)}</p>',
        f'<p class="verdict">{_e(verdict(plan, result, profile))}</p>',
        *([f'<p class="bad">{_e(warning)}</p>'] if warning else []),
        "<h2>Command</h2>",
        f'<pre class="cmd"><code>{_e(command)}</code></pre>',
        "<h2>Model</h2>",
        _kv_table(
            [
                ("workload", desc),
                ("model class", profile.model),
                ("device", profile.device),
                (
                    "blocks",
                    f"{len(profile.blocks)} ({profile.blocks[0].name} to {profile.blocks[-1].name})"
                    if profile.blocks
                    else "0",
                ),
                ("blocks form a chain", "yes" if profile.is_chain else "no"),
                ("held before a step", format_bytes(profile.held_bytes) + f" ({profile.loop.describe()})"),
                ("plain peak above that", format_bytes(profile.peak_bytes)),
                ("plain step time", f"{format_ms(profile.step_ms)} while profiling, {format_ms(base_ms)} in the bench"),
            ]
        ),
        "<h2>Key figures</h2>",
        '<div class="cards">' + "".join(_card(v, k) for v, k in _key_figures(profile, plan, row, base_ms)) + "</div>",
        "<h2>The chosen plan</h2>",
        f"<p><b>{_e(plan.strategy)}</b>: {_e(plan.headline())}.</p>",
        _plan_html(plan),
        f'<p class="legend">In compact form (<code>plan.describe()</code>, as in logs): <code>{_e(plan.describe())}</code>'
        f"<br>{_e(LEGEND)}.</p>",
        f"<p>Saved as <code>{REPORT_PLAN}</code> next to this report; measure it on its own with "
        f"<code>{_e(measure_cmd)}</code>, or apply it in Python with <code>{_e(apply_call)}</code>.</p>",
        "<h3>Predicted against measured</h3>",
        _table(
            ("figure", "predicted", "measured", "measured vs predicted"), _versus_rows(plan, row, base_ms, timelines)
        ),
    ]
    verdicts = budget_verdicts(result)  # the noise warning opens the report, not repeated here
    if verdicts:
        parts.append("<ul>" + "".join(f"<li>{_e(v)}</li>" for v in verdicts) + "</ul>")
    parts.append("<h2>Charts</h2>")
    for name, chart in CHARTS.items():
        if name in charts:
            parts.append(
                f"<figure><h3>{_e(chart.title)}</h3>{_img(Path(charts[name]))}"
                f"<figcaption>{_e(chart.caption)}</figcaption></figure>"
            )
    chosen_index = next((i for i, r in enumerate(result.rows) if r is row), None)
    frontier_rows, frontier_chosen = _frontier_rows(frontier, plan, profile, base_ms)
    parts += [
        "<h2>Bench: every strategy measured</h2>",
        f"<p>{_e(result.model)} on {_e(result.device)}; median of {result.rounds} interleaved rounds; peaks above "
        f"{_e(format_bytes(result.held_bytes))} held before the step ({_e(result.loop.describe())}); percentages against "
        f"<code>{_e(result.rows[0].label if result.rows else '-')}</code>. Predicted step time: the plain step plus "
        f"the predicted recompute time. The column “blocks recomputed” counts {_e(RECOMPUTED_NOTE)}.</p>",
        _table(BENCH_HEADERS, bench_rows(result), highlight=chosen_index),
        *(["<h2>Timelines</h2>", _table(_TIMELINE_HEADERS, _timeline_rows(timelines, result))] if timelines else []),
        "<h2>Profile</h2>",
        f"<p>Every block of the plain model measured on its batch (medians of timed steps). "
        f"Blocks form a chain: {'yes' if profile.is_chain else 'no'}.</p>",
        _table(PROFILE_HEADERS, profile_rows(profile), numeric_from=3),
        "<h2>Optimal frontier (predicted)</h2>",
        "<p>The fastest plan the solver finds for each peak, from the smallest peak it can reach to keeping "
        f"everything: peaks above the held memory, extra time per step against the plain step of {_e(format_ms(base_ms))}. "
        "The highlighted row is the chosen plan.</p>",
        _table(
            ("predicted peak", "of the plain peak", "extra time per step", "what it recomputes"),
            frontier_rows,
            numeric_from=0,
            text={3},
            highlight=frontier_chosen,
        ),
        "</body></html>",
    ]
    return "\n".join(parts)


def _versus_rows(plan: Plan, row: BenchRow | None, base_ms: float, timelines: Sequence[Timeline]) -> list[list[str]]:
    predicted_ms = None if plan.predicted_extra_ms is None else base_ms + plan.predicted_extra_ms
    peak = "-" if row is None else format_bytes(row.peak_bytes)
    step = "-" if row is None else format_ms(row.step_ms)
    rows = [
        [
            "peak memory",
            "-" if plan.predicted_peak_bytes is None else format_bytes(plan.predicted_peak_bytes),
            peak,
            "-" if row is None else ratio_pct(row.peak_bytes, plan.predicted_peak_bytes),
        ],
        [
            "step time",
            "-" if predicted_ms is None else format_ms(predicted_ms),
            step,
            "-" if row is None or predicted_ms is None else ratio_pct(row.step_ms, predicted_ms),
        ],
    ]
    if plan.budget_bytes is not None and row is not None:
        verdict = "fits" if row.peak_bytes <= plan.budget_bytes else "over budget"
        rows.append(["budget", format_bytes(plan.budget_bytes), verdict, ratio_pct(row.peak_bytes, plan.budget_bytes)])
    for tl in timelines:
        if tl.plan == plan.strategy:
            rows.append(
                ["timeline peak", "-", format_bytes(tl.peak_bytes), ratio_pct(tl.peak_bytes, plan.predicted_peak_bytes)]
            )
    return rows


_TIMELINE_HEADERS = ("plan", "timeline peak", "bench peak", "timeline vs bench", "step (under profiler)")


def _timeline_rows(timelines: Sequence[Timeline], result: BenchResult) -> list[list[str]]:
    by_label = {r.label: r for r in result.rows}
    out = []
    for tl in timelines:
        r = by_label.get(tl.plan)
        out.append(
            [
                tl.plan,
                format_bytes(tl.peak_bytes),
                "-" if r is None else format_bytes(r.peak_bytes),
                "-" if r is None else ratio_pct(tl.peak_bytes, r.peak_bytes),
                format_ms(tl.duration_ms),
            ]
        )
    return out


def _md_escape(text: str) -> str:
    return html.escape(text, quote=False).replace("|", "\\|")


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table, every cell escaped."""
    return [
        "| " + " | ".join(map(_md_escape, headers)) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(map(_md_escape, cells)) + " |" for cells in rows),
    ]


def _markdown(directory: Path, data: ReportData, command: str, desc: str, charts: Mapping[str, Path]) -> str:
    """The Markdown summary (see :func:`write_report`)."""
    profile, plan, result, timelines = data.profile, data.plan, data.result, data.timelines
    row = result.row_of(plan)
    base_ms = baseline_step_ms(result, profile.step_ms)
    lines = [
        f"# remat report: {_md_escape(desc)}",
        "",
        f"**{_md_escape(verdict(plan, result, profile))}**",
        "",
        *([f"**{_md_escape(warning)}**", ""] if (warning := noise_warning(result)) else []),
        "```",
        command.replace("```", "'''"),
        "```",
        "",
        f"- device: {profile.device}; {len(profile.blocks)} blocks; held before a step: {format_bytes(profile.held_bytes)}",
        f"- plain step: peak {format_bytes(profile.peak_bytes)} above held memory, {format_ms(base_ms)}",
    ]
    if plan.budget_bytes is not None:
        lines.append(f"- budget: {format_bytes(plan.budget_bytes)}")
    if row is not None:
        lines.append(
            f"- **{_md_escape(plan.strategy)}**: measured peak {format_bytes(row.peak_bytes)} "
            f"(predicted {format_bytes(row.predicted_peak_bytes) if row.predicted_peak_bytes is not None else '-'}, "
            f"{row.saved_pct:.1f}% saved), step {format_ms(row.step_ms)} ({row.overhead_pct:+.1f}%), "
            f"gradients equal: {'yes' if row.grads_equal else 'NO'}"
        )
    measure_cmd, apply_call = _reuse(command, directory)
    lines += [
        "",
        f"## Plan: {_md_escape(plan.strategy)}",
        "",
        f"{_md_escape(plan.headline())}.",
        "",
        *_plan_md(plan),
        "",
        f"In compact form: `{plan.describe()}` ({_md_escape(LEGEND)}).",
        "",
        f"Saved as `{REPORT_PLAN}`: `{measure_cmd}`, or in Python `{apply_call}`.",
        "",
        "## Bench",
        "",
        f"The column “blocks recomputed” counts {_md_escape(RECOMPUTED_NOTE)}.",
        "",
    ]
    lines += _md_table(BENCH_HEADERS, bench_rows(result))
    if timelines:
        # The step under the profiler is left out of the summary: the bench's step times are the ones to read.
        lines += [
            "",
            "## Timelines",
            "",
            *_md_table(_TIMELINE_HEADERS[:4], [r[:4] for r in _timeline_rows(timelines, result)]),
        ]
    lines += ["", "## Charts", ""]
    for name, chart in CHARTS.items():
        if name in charts:
            p = Path(charts[name]).resolve()
            link = (
                p.relative_to(directory.resolve()).as_posix() if p.is_relative_to(directory.resolve()) else p.as_uri()
            )
            lines += [f"### {chart.title}", "", f"![{name}]({link})", ""]
    lines += ["", f"Full report with the profile table: [{REPORT_HTML}]({REPORT_HTML})", ""]
    return "\n".join(lines)
