"""Issue #9's share targets with more rounds: none against remat's plans at shares of none's peak.

Usage: python benchmarks/targets.py [--workloads A,B] [--shares 50%,20%] [--rounds 15] [--small]

Why: in ``benchmarks/peers.py`` (7 rounds, 18 rows per workload, a minute per round on A) three rows
with the same plan measured +0.2%, +6.2% and +7.0% over none on B: on this 2-core CPU a step's time
drifts by 10-20% over a run, and a ratio of two medians taken over different rounds carries that. This
script times only none and remat's plans at the given shares (default and split blocks), interleaved
round by round (each round starts one row later), and reports for each plan the median of its
per-round ratios to none's step of the same round (paired), with their interquartile range, besides
the ratio of medians. Gradients are compared bitwise with none's, peaks are remat.measure's.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402

import remat  # noqa: E402
from remat.units import parse_budget  # noqa: E402


def run(name: str, shares: list[str], rounds: int, small: bool) -> list[dict[str, Any]]:
    """Rows of one workload: none first, then each (blocks, share) plan; times of every round, ms."""
    w = peers.build(name, small)
    plain = w.model
    none_peak = remat.measure(plain, w.inputs, w.loss_fn, steps=1, blocks=(), progress=False).peak_bytes
    rows: list[dict[str, Any]] = [{"row": "none", "model": plain, "peak_bytes": none_peak}]
    for tag, blocks in (("remat", None), ("remat split", remat.blocks(plain, split=True))):
        prof = remat.profile(plain, w.inputs, w.loss_fn, blocks=blocks, repeats=5, progress=False)
        for share in shares:
            row: dict[str, Any] = {"row": f"{tag} @ {share}"}
            try:
                plan = remat.plan(prof, share)
            except remat.BudgetInfeasibleError as e:
                row["infeasible"] = e.min_peak_bytes
                rows.append(row)
                continue
            model = copy.deepcopy(plain)
            remat.apply(model, plan)
            m = remat.measure(model, w.inputs, w.loss_fn, steps=1, progress=False)
            row.update(model=model, plan=plan.describe(), peak_bytes=m.peak_bytes, budget_bytes=plan.budget_bytes)
            row["predicted_peak_bytes"] = plan.predicted_peak_bytes
            rows.append(row)
    live = [r for r in rows if "model" in r]
    reference = peers.gradients(plain, w)
    for r in live:
        r["grads_equal"] = peers.compare(reference, peers.gradients(r["model"], w))[0]
        r["times_ms"] = []
    for k, order in enumerate(peers.rotations(len(live), rounds)):
        for i in order:
            ms = peers.timed_step(live[i]["model"], w)
            if k:  # round 0 warms every row up
                live[i]["times_ms"].append(ms)
        peers.log(f"{name}: round {k}/{rounds}")
    for r in rows:
        if r.get("model") is not None and r["row"] != "none":
            remat.remove(r["model"])
        r.pop("model", None)
    return rows


def _quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def table(name: str, rows: list[dict[str, Any]]) -> str:
    """A markdown table of one workload's rows."""
    none = rows[0]
    lines = [
        f"### {name}",
        "",
        "| row | peak / none | measured / predicted | measured / budget | grads | paired overhead (median) | "
        "paired IQR | overhead, ratio of medians |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if "infeasible" in r:
            lines.append(f"| {r['row']} | infeasible (least {r['infeasible'] / none['peak_bytes']:.3f}) | | | | | | |")
            continue
        peak = f"{r['peak_bytes'] / none['peak_bytes']:.3f}"
        if r["row"] == "none":
            lines.append(f"| none | {peak} | | | | median step {statistics.median(r['times_ms']):.1f} ms | | |")
            continue
        ratios = [a / b for a, b in zip(r["times_ms"], none["times_ms"], strict=True)]
        lo, hi = _quartiles(ratios)
        of_medians = statistics.median(r["times_ms"]) / statistics.median(none["times_ms"])
        lines.append(
            f"| {r['row']} | {peak} | {r['peak_bytes'] / r['predicted_peak_bytes']:.3f} | "
            f"{r['peak_bytes'] / r['budget_bytes']:.3f} | {'equal' if r['grads_equal'] else 'DIFFER'} | "
            f"{statistics.median(ratios) - 1:+.1%} | {lo - 1:+.1%} .. {hi - 1:+.1%} | {of_medians - 1:+.1%} |"
        )
    lines += ["", *(f"- {r['row']}: {r['plan']}" for r in rows if r.get("plan"))]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="A,B", help=f"comma-separated, of {', '.join(peers.WORKLOADS)}")
    parser.add_argument("--shares", default="50%,20%", help="comma-separated budgets as shares of none's peak")
    parser.add_argument("--rounds", type=int, default=15, help="timed interleaved rounds (after one warm-up round)")
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a smoke test")
    args = parser.parse_args()
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in peers.WORKLOADS]
    if unknown:
        parser.error(f"unknown workload {', '.join(unknown)}; valid: {', '.join(peers.WORKLOADS)}")
    shares = [s for s in args.shares.split(",") if s]
    for share in shares:
        if not share.endswith("%"):
            parser.error(f"--shares takes shares of none's peak such as 50%, not {share!r}")
        parse_budget(share)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    print(f"environment: {peers.environment()}")
    print(f"{args.rounds} timed interleaved rounds per workload; paired: each round's step over none's in that round\n")
    for name in names:
        t0 = time.perf_counter()
        print(table(name, run(name, shares, args.rounds, args.small)), flush=True)
        print(f"\n({time.perf_counter() - t0:.0f}s for this workload)\n", flush=True)


if __name__ == "__main__":
    main()
