"""The zoo table: every zoo model under every strategy and the optimal planner, judged against the plain model.

Each cell is ``equal`` (loss, outputs, gradients and buffers bitwise equal to the plain model's),
``refused`` (a ``RematError`` with a reason, model untouched; ``infeasible (min X%)`` for a budget
below the smallest feasible peak, X% of the plain peak), ``SILENT DIFF`` (what differs is listed
below), ``BAD REFUSAL`` (a ``RematError`` that changed the model or gives no reason) or ``crash`` (any
other exception). Reasons and errors are listed once below the table and referred to by number. The
models and the oracle are those of ``tests/zoo`` (its test fails on any cell not equal or refused).

Run from the repository root::

    OMP_NUM_THREADS=1 python benchmarks/zoo_table.py [--models chain hidden_states ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the zoo lives in tests/zoo

from remat.errors import BudgetInfeasibleError, RematError  # noqa: E402
from remat.profile import Profile  # noqa: E402
from tests.zoo.models import BUDGET_CELLS, CELLS, ZOO, Outcome, Verdict, ZooRun  # noqa: E402


def _note(text: str, notes: dict[str, int]) -> int:
    return notes.setdefault(" ".join(text.split()), len(notes) + 1)


def _cell(outcome: Outcome, prof: Profile | BaseException, notes: dict[str, int]) -> str:
    if outcome.verdict is Verdict.EQUAL:
        return "equal"
    if outcome.verdict is Verdict.SILENT_DIFF:
        return "**SILENT DIFF**"
    if isinstance(outcome.error, BudgetInfeasibleError) and isinstance(prof, Profile):
        # One note per budget would drown the others: the smallest feasible peak says it all.
        return f"infeasible (min {outcome.error.min_peak_bytes / prof.peak_bytes:.0%})"
    word = {Verdict.REFUSED: "refused", Verdict.BAD_REFUSAL: "**BAD REFUSAL**", Verdict.CRASH: "**crash**"}
    return f"{word[outcome.verdict]} [{_note(outcome.detail, notes)}]"


def _profile_cell(prof: Profile | BaseException, notes: dict[str, int]) -> str:
    if isinstance(prof, Profile):
        return "chain" if prof.is_chain else "not a chain"
    text = str(prof) if isinstance(prof, RematError) else f"in remat.profile: {type(prof).__name__}: {prof}"
    return f"{'refused' if isinstance(prof, RematError) else '**crash**'} [{_note(text, notes)}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(ZOO), choices=list(ZOO), metavar="MODEL")
    args = parser.parse_args()

    start = time.perf_counter()
    run = ZooRun({name: ZOO[name] for name in args.models})
    notes: dict[str, int] = {}
    counts: dict[Verdict, int] = dict.fromkeys(Verdict, 0)
    diffs: list[str] = []
    plans: list[str] = []
    rows = []
    for name in args.models:
        row = [name, _profile_cell(run.profile(name), notes)]
        for label, cell in CELLS.items():
            outcome = run.judge(name, cell)
            counts[outcome.verdict] += 1
            row.append(_cell(outcome, run.profile(name), notes))
            if outcome.verdict is Verdict.SILENT_DIFF:
                diffs.append(f"- {name} x {label}: {outcome.detail}")
            if label in BUDGET_CELLS and outcome.plan is not None:
                plans.append(f"| {name} | {label} | `{outcome.plan.describe()}` |")
        rows.append(row)

    header = ["model", "profile", *CELLS]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    print(", ".join(f"{v.value}: {counts[v]}" for v in Verdict) + f" ({sum(counts.values())} cells)")
    if notes:
        print("\nReasons and errors:\n")
        for text, number in notes.items():
            print(f"{number}. " + text.replace("|", "\\|"))
    if diffs:
        print("\nSilent differences (what is not bitwise equal):\n")
        print("\n".join(diffs))
    if plans:
        print("\nPlans of the optimal planner that ran:\n")
        print("| model | budget | plan |\n|---|---|---|")
        print("\n".join(plans))
    print(f"\n{len(args.models)} models, {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
