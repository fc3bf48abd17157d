"""``remat measure MODEL --plan plan.json``: apply a plan, measure real steps, write measure.json."""

from __future__ import annotations

import argparse
import shlex
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from remat.apply import apply, remove
from remat.cli.common import (
    add_model_args,
    check_model,
    check_out_file,
    check_positive,
    console,
    load_workload,
    loop_flags,
    loop_of,
    loop_options,
    read_plan,
    write_file,
)
from remat.errors import RematWarning
from remat.measure import GradientCheck, check_gradients
from remat.measure import measure as run_measure
from remat.plan.types import Plan
from remat.units import format_bytes, format_ms

HELP = "apply a plan (plan.json) to the model and measure real training steps against the plain model"


def add_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``remat measure``."""
    add_model_args(p)
    p.add_argument(
        "--plan", type=Path, default=None, help="plan.json from `remat plan` (default: measure the plain model)"
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps (median), default 5")
    p.add_argument(
        "--out", type=Path, default=Path("measure.json"), help="where to write the figures (default measure.json)"
    )


def check(args: argparse.Namespace) -> None:
    """Every mistake that can be seen without building the model, caught before anything is measured."""
    check_positive("--steps", args.steps)
    check_out_file("--out", args.out)
    if args.plan is not None:
        read_plan(args.plan)
    check_model(args.model, args.sizes)


def run(args: argparse.Namespace) -> int:
    """Measure the plain model and the planned one in the same run; print ratios; write the JSON."""
    # A bad plan file, or a plan for other blocks, is reported (one error line) before anything is measured.
    plan = read_plan(args.plan) if args.plan is not None else None
    if plan is not None:
        warn_other_loop(args, plan)
    w = load_workload(args.model, args.sizes)
    if plan is not None:
        apply(w.model, plan)
        remove(w.model)
    plain = run_measure(w.model, w.inputs, w.loss_fn, steps=args.steps, **loop_options(args))
    if plan is None:
        result = plain
    else:
        with remat_warnings() as shown:
            apply(w.model, plan)
            try:
                result = run_measure(w.model, w.inputs, w.loss_fn, steps=args.steps, **loop_options(args))
            finally:
                remove(w.model)
            check = check_gradients(w.model, plan, w.inputs, w.loss_fn)
        for message in shown():
            console.print(f"[yellow]warning:[/] {message}", highlight=False)
        predicted = f" (predicted {format_bytes(plan.predicted_peak_bytes)})" if plan.predicted_peak_bytes else ""
        console.print(
            f"{plan.strategy}: peak {format_bytes(result.peak_bytes)}{predicted} = {result.peak_bytes / plain.peak_bytes:.1%} "
            f"of plain {format_bytes(plain.peak_bytes)}; step {format_ms(result.step_ms)} = "
            f"{result.step_ms / plain.step_ms:.2f}x plain {format_ms(plain.step_ms)}; gradients "
            f"{_verdict(check)}"
        )
        console.print(f"forward runs per block: {result.forward_counts}")
        if plan.budget_bytes and result.peak_bytes > plan.budget_bytes * 1.05:
            console.print(
                f"[yellow]warning:[/] the measured peak {format_bytes(result.peak_bytes)} is "
                f"{result.peak_bytes / plan.budget_bytes:.2f}x the plan's budget {format_bytes(plan.budget_bytes)}: "
                "the plan was made on another batch or model (the --set sizes of its profile?), or for another loop; "
                "profile and plan this workload again",
                highlight=False,
            )
    if plan is None:
        console.print(
            f"plain: peak {format_bytes(plain.peak_bytes)} above {format_bytes(plain.held_bytes)} held; step {format_ms(plain.step_ms)}"
        )
    write_file(args.out, result.to_json())
    console.print(f"wrote {args.out}")
    return 0


@contextmanager
def remat_warnings() -> Iterator[Callable[[], list[str]]]:
    """Collect the ``RematWarning``s raised inside (a plan applied to a larger batch than its profile's: NOTE
    [ Batches larger than the profiled one ] in ``remat.core.runtime``), each message once, to print as the
    command's own warnings; other warnings are shown as usual."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RematWarning)
        messages: list[str] = []
        yield lambda: messages
    for w in caught:
        if issubclass(w.category, RematWarning):
            if str(w.message) not in messages:
                messages.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def warn_other_loop(args: argparse.Namespace, plan: Plan) -> None:
    """Warn when ``--grads`` / ``--optimizer`` run another loop than the one the plan's profile measured:
    its predicted peak is for that loop, so the measured one does not compare to it."""
    ours = loop_of(args)
    if plan.loop is None or plan.loop == ours:
        return
    flags = loop_flags(plan.loop)
    if flags is None:
        fix = "measure it in Python with that loop"
    elif flags:
        fix = f"pass {shlex.join(flags)} to measure the plan's loop"
    else:
        fix = "leave out --grads and --optimizer to measure the plan's loop"
    console.print(
        f"[yellow]warning:[/] the plan was made for the {plan.loop.describe()}; this run measures the "
        f"{ours.describe()}, so its peak does not compare to the plan's prediction; {fix}",
        highlight=False,
    )


def _verdict(check: GradientCheck) -> str:
    if check.equal:
        return "bitwise equal" if check.exact else "equal"
    own = " (two plain steps differ too: the model is not deterministic)" if check.plain_repeatable is False else ""
    return f"DIFFER: {', '.join(check.mismatched[:3])}{own}"
