"""HuggingFace models from tiny configs (hidden states out, dropout on): remat's plans, measured in one run.

For each of GPT-2, Llama, BERT, T5 and ViT (the builders of tests/hf/test_hf.py, nothing downloaded):
``none``, ``segments(2)``, ``sqrt()`` and the optimal plan at 30/50/70% of the plain peak, timed in
interleaved rounds (medians) by remat's bench engine, with exact CPU peaks and the gradient oracle.
Prints a Markdown table: peak / budget, measured / predicted peak, step overhead against ``none`` in the
same run, and whether every gradient is bitwise equal.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=0 \\
    OMP_WAIT_POLICY=PASSIVE python benchmarks/hf_table.py --rounds 7
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import remat  # noqa: E402
from remat.measure.compare import compare  # noqa: E402
from tests.hf.test_hf import HF  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", nargs="*", default=list(HF))
    args = parser.parse_args()
    print("| model | plan | peak / budget | measured / predicted | overhead vs none | grads |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        case = HF[name]()
        # Gradients held (zeroed in place), as in tests/hf: on configs this small parameter gradients
        # outweigh the activations, so budgets of 30-70% need that loop.
        prof = remat.profile(case.model, case.inputs, case.loss_fn, repeats=3, grads="held")
        plans = [
            remat.plan(prof, strategy=remat.none()),
            remat.plan(prof, strategy=remat.segments(2)),
            remat.plan(prof, strategy=remat.sqrt()),
        ]
        for share in ("30%", "50%", "70%"):
            plans.append(remat.plan(prof, share))
        result = compare(
            case.model, case.inputs, case.loss_fn, plans, rounds=args.rounds, description=name, grads="held"
        )
        for plan, row in zip(plans, result.rows):
            budget = f"{row.peak_bytes / plan.budget_bytes:.3f}" if plan.budget_bytes else "-"
            pred = f"{row.peak_bytes / plan.predicted_peak_bytes:.3f}" if plan.predicted_peak_bytes else "-"
            label = (
                f"{plan.strategy} @ {plan.budget_bytes / prof.peak_bytes:.0%}" if plan.budget_bytes else plan.strategy
            )
            print(
                f"| {name} | {label} | {budget} | {pred} | {row.overhead_pct:+.1f}% "
                f"(peak {row.peak_bytes / result.rows[0].peak_bytes:.2f}x) | {'bitwise' if row.grads_equal else 'DIFFER'} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
