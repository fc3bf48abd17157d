"""Rich tables and trees for profiles, plans and bench results."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.tree import Tree

from remat.measure.compare import BenchResult
from remat.plan.chain import Keep, Op, Recompute, RecomputeSub
from remat.plan.types import Plan
from remat.profile.types import Profile
from remat.units import format_bytes, format_ms

__all__ = ["PROFILE_HEADERS", "profile_rows", "BENCH_HEADERS", "bench_rows", "ratio_pct", "profile_table", "plan_tree", "plans_table", "bench_table", "budget_verdicts", "mib"]


def mib(n: int | float | None) -> str:
    """Bytes as MiB with one decimal (``'-'`` for ``None``)."""
    return "-" if n is None else f"{n / 2**20:.1f}"


def _gflops(n: int) -> str:
    return f"{n / 1e9:.2f}"


PROFILE_HEADERS = ("#", "block", "type", "in MiB", "out MiB", "saved MiB", "fwd tmp MiB", "bwd peak MiB", "fwd ms", "bwd ms", "fwd GFLOP")


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


def profile_table(profile: Profile) -> Table:
    """One row per block: type, input/output/saved bytes, transients, times and FLOPs."""
    t = Table(title=f"{profile.model} on {profile.device}: {len(profile.blocks)} blocks", title_justify="left")
    for col in PROFILE_HEADERS:
        t.add_column(col, justify="left" if col in ("block", "type") else "right")
    for row in profile_rows(profile):
        t.add_row(*row)
    t.caption = (
        f"unplanned peak {format_bytes(profile.peak_bytes)} above {format_bytes(profile.held_bytes)} held; "
        f"step {format_ms(profile.step_ms)}; blocks form a chain: {'yes' if profile.is_chain else 'no'}"
    )
    return t


def _add_ops(node: Tree, ops: Sequence[Op], plan: Plan) -> None:
    for op in ops:
        if isinstance(op, Keep):
            node.add(f"[green]keep[/] {plan.blocks[op.index].name}")
        elif isinstance(op, RecomputeSub):
            node.add(f"[yellow]keep, recompute {', '.join(op.fqns)}[/] in {plan.blocks[op.index].name}")
        elif isinstance(op, Recompute):
            names = f"{plan.blocks[op.start].name}" + (f" .. {plan.blocks[op.stop - 1].name}" if op.stop - op.start > 1 else "")
            child = node.add(f"[red]recompute[/] {names}")
            if any(not isinstance(o, Keep) for o in op.inner) or len(op.inner) > 1:
                _add_ops(child, op.inner, plan)


def plan_tree(plan: Plan) -> Tree:
    """The plan as a tree: kept blocks, recomputed segments and what each recompute keeps inside."""
    root = Tree(f"[bold]{plan.strategy}[/]: {len(plan.checkpointed)}/{len(plan.blocks)} blocks recomputed, depth {plan.depth}")
    _add_ops(root, plan.ops, plan)
    return root


def plans_table(plans: Sequence[Plan]) -> Table:
    """Predicted peak and recompute time of several plans side by side."""
    t = Table(title="predicted", title_justify="left")
    for col in ("plan", "checkpointed", "predicted peak MiB", "of unplanned", "predicted recompute ms", "of a step"):
        t.add_column(col, justify="left" if col == "plan" else "right")
    for p in plans:
        base_peak, base_ms = p.baseline_peak_bytes or 0, p.baseline_step_ms or 0.0
        t.add_row(
            p.strategy,
            f"{len(p.checkpointed)}/{len(p.blocks)}",
            mib(p.predicted_peak_bytes),
            f"{p.predicted_peak_bytes / base_peak:.0%}" if base_peak and p.predicted_peak_bytes is not None else "-",
            f"{p.predicted_extra_ms:.1f}" if p.predicted_extra_ms is not None else "-",
            f"+{p.predicted_extra_ms / base_ms:.0%}" if base_ms and p.predicted_extra_ms is not None else "-",
        )
    return t


BENCH_HEADERS = (
    "strategy",
    "blocks ckpt",
    "peak MiB",
    "predicted MiB",
    "peak vs predicted",
    "budget MiB",
    "step ms",
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


def bench_rows(result: BenchResult, *, fits: tuple[str, str] = (" fits", " OVER"), equal: tuple[str, str] = ("yes", "NO")) -> list[list[str]]:
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
                f"{r.checkpointed}/{r.n_blocks}",
                mib(r.peak_bytes),
                mib(r.predicted_peak_bytes),
                ratio_pct(r.peak_bytes, r.predicted_peak_bytes),
                budget,
                f"{r.step_ms:.1f}",
                "-" if predicted_ms is None else f"{predicted_ms:.1f}",
                f"{r.saved_pct:.1f}%",
                f"{r.overhead_pct:+.1f}%",
                equal[not r.grads_equal],
            ]
        )
    return rows


def bench_table(result: BenchResult) -> Table:
    """The bench: measured peak and time of every plan, with predictions and the gradient check."""
    t = Table(title=f"{result.model} on {result.device}, median of {result.rounds} interleaved rounds", title_justify="left")
    for col in BENCH_HEADERS:
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for row in bench_rows(result, fits=(" [green]✓[/]", " [red]✗[/]"), equal=("[green]yes[/]", "[red]NO[/]")):
        t.add_row(*row)
    t.caption = f"peaks are above {format_bytes(result.held_bytes)} held before the step; percentages against '{result.rows[0].label}'"
    return t


def budget_verdicts(result: BenchResult) -> list[str]:
    """For each solved budget: is the optimal plan at least as fast as every seed strategy that fits it?"""
    lines = []
    seeds = [r for r in result.rows if r.budget_bytes is None]
    for r in result.rows:
        if r.budget_bytes is None or not r.label.startswith("optimal"):
            continue
        fitting = [s for s in seeds if s.peak_bytes <= r.budget_bytes]
        faster = [s for s in fitting if s.step_ms < r.step_ms]
        best = min(fitting, key=lambda s: s.step_ms) if fitting else None
        verdict = (
            "fastest of all that fit"
            if not faster
            else f"slower than {', '.join(f'{s.label} ({s.step_ms:.1f}ms)' for s in faster)}"
        )
        lines.append(
            f"budget {mib(r.budget_bytes)}MiB: optimal {r.step_ms:.1f}ms, measured peak {mib(r.peak_bytes)}MiB "
            f"(predicted {mib(r.predicted_peak_bytes)}); {len(fitting)} seed strategies fit"
            + (f", best {best.label} {best.step_ms:.1f}ms" if best else "")
            + f" -> {verdict}"
        )
    return lines
