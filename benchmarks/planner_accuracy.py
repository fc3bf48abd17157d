"""Does the optimal plan hold its budget when measured, and how close is its prediction?

For each workload and each budget (a share of the measured unplanned peak): solve, apply, measure the
peak of a real step, check gradients against the plain model, and compare the plan's measured step
time with every seed strategy whose measured peak fits the same budget (interleaved timing rounds,
medians). Prints ratios measured in this run; nothing is asserted.

Run with the environment the Makefile's bench target sets, e.g.::

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=0 \\
    OMP_WAIT_POLICY=PASSIVE python benchmarks/planner_accuracy.py
"""

from __future__ import annotations

import argparse

import remat
from remat.measure.compare import compare
from remat.models import workload
from remat.plan.strategies import bench_strategies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "mlp"])
    parser.add_argument("--shares", nargs="+", type=float, default=[0.3, 0.5, 0.7])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--grads", choices=["none", "held"], default="none", help="the loop measured (remat.measure.Grads)"
    )
    args = parser.parse_args()
    loop = {"grads": args.grads}
    for name in args.models:
        w = workload(name)
        prof = remat.profile(w.model, w.inputs, w.loss_fn, **loop)
        unplanned = remat.measure(w.model, w.inputs, w.loss_fn, steps=1, **loop).peak_bytes
        seeds = [remat.plan(prof, strategy=s) for s in bench_strategies(prof.blocks, prof)]
        optimal = [remat.plan(prof, int(share * unplanned)) for share in args.shares]
        result = compare(
            w.model, w.inputs, w.loss_fn, seeds + optimal, rounds=args.rounds, description=w.description, **loop
        )
        rows = {r.label: r for r in result.rows}
        base = result.rows[0]
        print(
            f"\n{w.description}: unplanned peak {unplanned / 2**20:.1f} MiB, step {base.step_ms:.1f} ms; {prof.loop.describe()}"
        )
        print(
            f"{'budget':>7} {'budget MiB':>10} {'measured':>9} {'predicted':>9} {'meas/budget':>11} {'meas/pred':>9} "
            f"{'grads':>5} {'step ms':>8} {'best fitting seed':>34} {'depth':>5}  plan"
        )
        for share, plan in zip(args.shares, optimal):
            row = result.rows[len(seeds) + args.shares.index(share)]
            fitting = [r for r in result.rows[: len(seeds)] if r.peak_bytes <= plan.budget_bytes]  # type: ignore[operator]
            best = min(fitting, key=lambda r: r.step_ms) if fitting else None
            best_txt = f"{best.label[:24]} {best.step_ms:.1f}ms" if best else "none fits"
            print(
                f"{share:>7.0%} {plan.budget_bytes / 2**20:>10.2f} {row.peak_bytes / 2**20:>9.2f} "  # type: ignore[operator]
                f"{plan.predicted_peak_bytes / 2**20:>9.2f} {row.peak_bytes / plan.budget_bytes:>11.3f} "  # type: ignore[operator]
                f"{row.peak_bytes / plan.predicted_peak_bytes:>9.3f} {'yes' if row.grads_equal else 'NO':>5} "  # type: ignore[operator]
                f"{row.step_ms:>8.1f} {best_txt:>34} {plan.depth:>5}  {plan.describe()}"
            )
        del rows


if __name__ == "__main__":
    main()
