"""Rich tables and trees for profiles, plans and bench results."""

from __future__ import annotations

import re
from collections.abc import Sequence

from rich import box
from rich.table import Table
from rich.tree import Tree

from remat.errors import RematError
from remat.measure.compare import BenchResult, BenchRow, separable
from remat.plan.types import BlockFate, Fate, Plan, block_fates, ops_from_text
from remat.profile.types import Profile
from remat.units import format_bytes, format_ms

__all__ = [
    "PROFILE_HEADERS",
    "profile_rows",
    "BENCH_HEADERS",
    "bench_rows",
    "ratio_pct",
    "profile_table",
    "plan_tree",
    "plans_table",
    "recomputed_cell",
    "RECOMPUTED_NOTE",
    "bench_table",
    "budget_verdicts",
    "noise_warning",
    "short_label",
    "mib",
]

# NOTE [ Terminal tables ]
# The terminal tables must stay readable at 100 columns: they use short headers with the unit in the
# caption, a border-less box (the bench's with two spaces between columns, not three), and leave out
# columns that the JSON and the HTML report carry (predicted peak and step in the bench). The HTML and
# Markdown tables use the full headers. Every table counts recomputed blocks the same way
# (``recomputed_cell``, NOTE [ Plan vocabulary ] in ``remat.plan.types``).


def mib(n: int | float | None) -> str:
    """Bytes as MiB with one decimal (``'-'`` for ``None``)."""
    return "-" if n is None else f"{n / 2**20:.1f}"


def _gflops(n: int) -> str:
    return f"{n / 1e9:.2f}"


PROFILE_HEADERS = (
    "#",
    "block",
    "type",
    "in MiB",
    "out MiB",
    "saved MiB",
    "fwd tmp MiB",
    "bwd peak MiB",
    "fwd ms",
    "bwd ms",
    "fwd GFLOP",
)


def profile_rows(profile: Profile) -> list[list[str]]:
    """The cells of the per-block profile table (``PROFILE_HEADERS``), for the terminal and HTML."""
    return [
        [
            str(i),
            b.name,
            b.type_hint.value,
            mib(bp.input_bytes),
            mib(bp.output_bytes),
            mib(bp.saved_bytes),
            mib(bp.fwd_transient_bytes),
            mib(bp.bwd_peak_bytes),
            f"{bp.fwd_ms:.2f}",
            f"{bp.bwd_ms:.2f}",
            _gflops(bp.fwd_flops),
        ]
        for i, (b, bp) in enumerate(zip(profile.blocks, profile.block_profiles))
    ]


# Terminal headers of the profile table, one per PROFILE_HEADERS entry (NOTE [ Terminal tables ]).
_PROFILE_SHORT = ("#", "block", "type", "in", "out", "saved", "fwd tmp", "bwd peak", "fwd ms", "bwd ms", "GFLOP")


def profile_table(profile: Profile) -> Table:
    """One row per block: type, input/output/saved bytes, transients, times and FLOPs (fits 100 columns)."""
    t = Table(
        title=f"{profile.model} on {profile.device}: {len(profile.blocks)} blocks",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        caption_justify="left",
    )
    for col in _PROFILE_SHORT:
        t.add_column(col, justify="left" if col in ("block", "type") else "right")
    for row in profile_rows(profile):
        t.add_row(*row)
    t.caption = (
        f"sizes in MiB (saved: kept for backward; tmp: transient); GFLOP of the forward\n"
        f"unplanned peak {format_bytes(profile.peak_bytes)} above {format_bytes(profile.held_bytes)} held; "
        f"step {format_ms(profile.step_ms)}; blocks form a chain: {'yes' if profile.is_chain else 'no'}"
    )
    return t


FATE_STYLES = {Fate.KEPT: "green", Fate.RECOMPUTED: "red", Fate.SEGMENT: "red", Fate.PART: "yellow"}
"""The rich colour of each fate, in the terminal tree (the HTML uses the same hues)."""


def plan_tree(plan: Plan) -> Tree:
    """The plan as a tree of :meth:`Plan.lines`: the headline, then what happens to each run of blocks,
    with what happens inside a segment below it (NOTE [ Plan vocabulary ])."""
    root = Tree(f"[bold]{plan.strategy}[/]\n{plan.headline()}")  # the headline alone fits 100 columns
    lines = list(plan.lines())
    width = max((len(plan.span(line.blocks)) for line in lines), default=0)
    parents = [root]
    for line in lines:
        del parents[line.depth + 1 :]
        node = parents[line.depth].add(f"{plan.span(line.blocks):<{width}}  [{FATE_STYLES[line.fate]}]{line.what}[/]")
        parents.append(node)
    return root


RECOMPUTED_NOTE = (
    "blocks recomputed whole (on their own or in segments) + blocks kept with a part recomputed: their "
    "attention or MLP, or selected operations under an op-level policy ('part')"
)
"""What the "recomputed" column of the plan and bench tables counts (:func:`recomputed_cell`)."""


def recomputed_cell(fates: Sequence[BlockFate]) -> str:
    """How many blocks a plan recomputes, for a table: ``'5'``, or ``'3 + 5 part'`` when some blocks are
    kept with only a part recomputed: their attention or MLP, or selected operations (NOTE [ Plan vocabulary ])."""
    whole = sum(f.fate in (Fate.RECOMPUTED, Fate.SEGMENT) for f in fates)
    part = sum(f.fate is Fate.PART for f in fates)
    return f"{whole} + {part} part" if part else str(whole)


def _row_recomputed(r: BenchRow) -> str:
    """The "recomputed" cell of a bench row, from its plan (rows read from older files: its compact form)."""
    if r.plan is not None:
        return recomputed_cell(r.plan.fates())
    try:
        fates = block_fates(ops_from_text(r.ops))
    except RematError:  # a row written by hand or by another version: its count is all there is
        return str(r.checkpointed)
    return recomputed_cell(fates) if len(fates) == r.n_blocks else str(r.checkpointed)


def plans_table(plans: Sequence[Plan]) -> Table:
    """Predicted peak and recompute time of several plans side by side (fits 100 columns)."""
    n = max((len(p.blocks) for p in plans), default=0)
    t = Table(title="predicted", title_justify="left", box=box.SIMPLE_HEAD, caption_justify="left")
    t.caption = f"recomputed: {RECOMPUTED_NOTE}, of {n} blocks"
    for col in ("plan", "recomputed", "peak MiB", "of unplanned", "recompute ms", "of a step"):
        t.add_column(col, justify="left" if col == "plan" else "right")
    for p in plans:
        base_peak, base_ms = p.baseline_peak_bytes or 0, p.baseline_step_ms or 0.0
        t.add_row(
            p.strategy,
            recomputed_cell(p.fates()),
            mib(p.predicted_peak_bytes),
            f"{p.predicted_peak_bytes / base_peak:.0%}" if base_peak and p.predicted_peak_bytes is not None else "-",
            f"{p.predicted_extra_ms:.1f}" if p.predicted_extra_ms is not None else "-",
            f"+{p.predicted_extra_ms / base_ms:.0%}" if base_ms and p.predicted_extra_ms is not None else "-",
        )
    return t


BENCH_HEADERS = (
    "strategy",
    "blocks recomputed",
    "peak MiB",
    "predicted MiB",
    "peak vs predicted",
    "budget MiB",
    "step ms",
    "spread",
    "predicted ms",
    "memory saved",
    "time overhead",
    "grads equal",
)


def ratio_pct(measured: float, predicted: float | None) -> str:
    """How far ``measured`` is from ``predicted``, as ``'+1.2%'`` (``'-'`` without a prediction)."""
    if predicted is None or predicted == 0:
        return "-"
    return f"{100.0 * (measured / predicted - 1):+.1f}%"


def bench_rows(
    result: BenchResult, *, fits: tuple[str, str] = (" fits", " OVER"), equal: tuple[str, str] = ("yes", "NO")
) -> list[list[str]]:
    """The cells of the bench table (``BENCH_HEADERS``), for the terminal (rich markup) and HTML (plain).

    The predicted step is the measured baseline (first row) plus the plan's predicted recomputation.
    """
    base_ms = result.rows[0].step_ms if result.rows else 0.0
    rows = []
    for r in result.rows:
        predicted_ms = None if r.predicted_extra_ms is None else base_ms + r.predicted_extra_ms
        budget = "-" if r.budget_bytes is None else mib(r.budget_bytes) + fits[r.peak_bytes > r.budget_bytes]
        rows.append(
            [
                r.label,
                _row_recomputed(r),
                mib(r.peak_bytes),
                mib(r.predicted_peak_bytes),
                ratio_pct(r.peak_bytes, r.predicted_peak_bytes),
                budget,
                f"{r.step_ms:.1f}",
                "-" if r.spread_pct is None else f"{r.spread_pct:.1f}%",
                "-" if predicted_ms is None else f"{predicted_ms:.1f}",
                f"{r.saved_pct:.1f}%",
                f"{r.overhead_pct:+.1f}%",
                equal[not r.grads_equal],
            ]
        )
    return rows


# Terminal columns of the bench: (short header, BENCH_HEADERS entry) (NOTE [ Terminal tables ]).
_BENCH_SHORT = (
    ("plan", "strategy"),
    ("recomputed", "blocks recomputed"),
    ("peak", "peak MiB"),
    ("vs pred", "peak vs predicted"),
    ("budget", "budget MiB"),
    ("step", "step ms"),
    ("spread", "spread"),
    ("saved", "memory saved"),
    ("overhead", "time overhead"),
    ("grads", "grads equal"),
)


def short_label(label: str) -> str:
    """A strategy label without parameter names, still valid for ``--strategy``: ``'every_nth(n=2)'`` -> ``'every_nth(2)'``."""
    return re.sub(r"(?<=[(,\s])[a-z_]+=", "", label)


def noise_warning(result: BenchResult) -> str | None:
    """The warning when the run-to-run spread is too large to rank the plans (NOTE [ Timing noise ]), else ``None``."""
    if result.rankable:
        return None
    noise, diff = result.noise_pct, result.difference_pct
    if noise is None:
        return (
            f"timings not ranked: with {result.rounds} round the run-to-run spread cannot be measured; "
            "use --rounds 5 or more"
        )
    return (
        f"WARNING: timings too noisy to rank the plans: run-to-run spread {noise:.0f}% (interquartile range / median) "
        f"is larger than the typical difference between plans ({diff or 0:.0f}%); close other programs or raise --rounds"
    )


def bench_table(result: BenchResult) -> Table:
    """The bench: measured peak and time of every plan, spread, the budget and gradient checks (fits 100 columns)."""
    t = Table(
        title=f"{result.model} on {result.device}, median of {result.rounds} interleaved rounds",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,  # NOTE [ Terminal tables ]
        caption_justify="left",
    )
    index = {h: i for i, h in enumerate(BENCH_HEADERS)}
    for short, _ in _BENCH_SHORT:
        t.add_column(short, justify="left" if short == "plan" else "right")
    for row in bench_rows(result, fits=(" [green]✓[/]", " [red]✗[/]"), equal=("[green]yes[/]", "[red]NO[/]")):
        cells = [row[index[full]] for _, full in _BENCH_SHORT]
        cells[0] = short_label(cells[0])
        t.add_row(*cells)
    base = result.rows[0].label if result.rows else "-"
    caption = (
        f"MiB, ms; {result.loop.describe()} ({format_bytes(result.held_bytes)} held); vs pred: measured peak against "
        f"predicted; spread: interquartile range / median of the rounds; saved, overhead: against '{short_label(base)}'; "
        f"predicted peaks and steps in --json\nrecomputed: {RECOMPUTED_NOTE}, of {result.rows[0].n_blocks if result.rows else 0} blocks"
    )
    warning = noise_warning(result)
    t.caption = caption + (f"\n[bold red]{warning}[/]" if warning else "")
    return t


def _faster(a: BenchRow, b: BenchRow) -> bool:
    # a is faster than b by more than either plan's run-to-run spread (NOTE [ Timing noise ]).
    return a.step_ms < b.step_ms and separable(a, b)


def budget_verdicts(result: BenchResult) -> list[str]:
    """The summary: for each solved budget whether the optimal plan is faster than every other plan whose
    measured peak fits it.

    "Faster" and "slower" are claimed only beyond the run-to-run spread (NOTE [ Timing noise ]); plans
    within it are named as ties. The noise warning is not repeated here: :func:`bench_table`'s caption
    and the reports show :func:`noise_warning` once.
    """
    lines: list[str] = []
    for r in result.rows:
        if r.budget_bytes is None or r.solver != "optimal":
            continue
        fitting = [s for s in result.rows if s is not r and s.peak_bytes <= r.budget_bytes]
        faster = [s for s in fitting if _faster(s, r)]
        ties = [s for s in fitting if s not in faster and not _faster(r, s)]
        named: list[BenchRow] = []
        if faster:
            named = sorted(faster, key=lambda s: s.step_ms)
            verdict = f"slower than {', '.join(f'{short_label(s.label)} ({s.step_ms:.1f}ms)' for s in named)}"
        elif ties:
            spreads = [x.spread_pct for x in (r, *ties) if x.spread_pct is not None]
            spread = f"spreads up to {max(spreads):.0f}%" if spreads else "not measured in 1 round"
            ties.sort(key=lambda s: s.step_ms)
            named = ties[:3]
            listed = ", ".join(f"{short_label(s.label)} ({s.step_ms:.1f}ms)" for s in named)
            more = f" and {len(ties) - 3} more" if len(ties) > 3 else ""
            verdict = (
                f"no faster plan fits, but {listed}{more} {'is' if len(ties) == 1 else 'are'} within the "
                f"run-to-run spread ({spread}): not ranked"
            )
        else:
            verdict = "fastest of all that fit" if fitting else "the only plan that fits"
        best = min(fitting, key=lambda s: s.step_ms) if fitting else None
        # The fastest other plan, unless the verdict names it already.
        best_words = f", best {short_label(best.label)} {best.step_ms:.1f}ms" if best and best not in named else ""
        lines.append(
            f"budget {mib(r.budget_bytes)}MiB: optimal {r.step_ms:.1f}ms, measured peak {mib(r.peak_bytes)}MiB "
            f"(predicted {mib(r.predicted_peak_bytes)}); {len(fitting)} other plans fit{best_words} -> {verdict}"
        )
    return lines
