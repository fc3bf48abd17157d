"""``remat plan MODEL --budget 40%``: the plan in words, predicted figures next to none and full, plan.json."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from remat.blocks import blocks as find_blocks
from remat.blocks import fingerprint
from remat.cli.common import (
    DEFAULT_MODEL,
    add_model_args,
    add_split_arg,
    block_options,
    check_model,
    check_out_file,
    console,
    load_workload,
    loop_flags,
    loop_of,
    loop_options,
    note_high_budgets,
    one_budget,
    read_profile,
    write_file,
)
from remat.errors import RematError
from remat.plan import SOLVERS
from remat.plan import plan as make_plan
from remat.plan.strategies import full, none
from remat.profile import Profile
from remat.profile import profile as run_profile
from remat.report.tables import plan_tree, plans_table
from remat.units import format_bytes

HELP = "solve for the fastest plan under a memory budget and show it (no training step is changed)"


def add_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``remat plan``."""
    add_model_args(p)
    add_split_arg(p)
    p.add_argument(
        "--budget",
        required=True,
        action="append",  # so that a second one is refused, not silently taken instead of the first
        help="bytes ('1.5GiB') or share of the unplanned peak ('40%%'); one (remat bench takes several)",
    )
    p.add_argument("--solver", default="optimal", choices=list(SOLVERS), help="default optimal")
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="read this profile.json instead of profiling: it holds the model and loop it measured, so "
        "MODEL, --set, --split, --grads and --optimizer are then only checked against it",
    )
    p.add_argument("--out", type=Path, default=Path("plan.json"), help="where to write the plan (default plan.json)")
    # None: not given (with --profile, only what is given is checked against the profile).
    p.set_defaults(model=None, grads=None, optimizer=None)


def check(args: argparse.Namespace) -> None:
    """Every mistake that can be seen without building the model, caught before anything is measured."""
    args.budget = one_budget(args.budget, "a plan")  # one, from here on
    check_out_file("--out", args.out)
    if args.profile is None:
        check_model(args.model or DEFAULT_MODEL, args.sizes)
        return
    prof = read_profile(args.profile)
    _check_loop(args, prof)
    if args.model is not None:
        check_model(args.model, args.sizes)
    elif args.sizes or args.split:
        given = " ".join([*(f"--set {item}" for item in args.sizes), *(["--split"] if args.split else [])])
        raise RematError(
            f"plan: {given} describes a model, but --profile {str(args.profile)!r} already holds the one it "
            f"measured ({prof.model}); drop {given}, or give MODEL too to check it against the profile"
        )


def _check_loop(args: argparse.Namespace, prof: Profile) -> None:
    """``--grads`` / ``--optimizer``, where given, must be the loop the profile measured."""
    ours = loop_of(args)
    given = [
        f"--{flag} {getattr(args, flag)}"
        for flag, differs in (
            ("grads", ours.grads is not prof.loop.grads),
            ("optimizer", ours.optimizer != prof.loop.optimizer),
        )
        if getattr(args, flag) is not None and differs
    ]
    if given:
        flags = loop_flags(prof.loop)
        again = f" (that is: {shlex.join(flags)})" if flags else ""
        raise RematError(
            f"plan: {' and '.join(given)} {'differs' if len(given) == 1 else 'differ'} from the loop --profile "
            f"{str(args.profile)!r} measured, the {prof.loop.describe()}{again}; the plan is for the profile's "
            f"loop: drop {' and '.join(g.split()[0] for g in given)}, or profile again with "
            f"{'it' if len(given) == 1 else 'them'}: remat profile MODEL {' '.join(given)}"
        )


def _check_model(args: argparse.Namespace, prof: Profile) -> None:
    """MODEL (with ``--set`` / ``--split``) must be the model the profile measured: its class and blocks.

    Only the model is built (no step runs). The profile records no input shapes, so a ``--set`` that
    changes only the batch goes unnoticed here; the plan records each block's input bytes, and the model it
    is applied to warns when a block takes more (NOTE [ Batches larger than the profiled one ]).
    """
    w = load_workload(args.model, args.sizes)
    found = find_blocks(w.model, split=args.split)
    if type(w.model).__name__ == prof.model and fingerprint(w.model, found) == prof.fingerprint:
        return
    words = shlex.join([args.model, *(f"--set={item}" for item in args.sizes), *(["--split"] if args.split else [])])
    if fingerprint(w.model, find_blocks(w.model, split=not args.split)) == prof.fingerprint:
        fix = (
            f"{'drop' if args.split else 'add'} --split: the profile was made {'without' if args.split else 'with'} it"
        )
    else:
        fix = f"drop MODEL and --set to plan on the profile alone, or profile this model: remat profile {words}"
    span = f" ({prof.blocks[0].name} to {prof.blocks[-1].name})" if prof.blocks else ""
    raise RematError(
        f"plan: {words} is not the model --profile {str(args.profile)!r} measured: it is a "
        f"{type(w.model).__name__} with {len(found)} blocks, the profile's a {prof.model} with "
        f"{len(prof.blocks)} blocks{span} (fingerprints {fingerprint(w.model, found)} and {prof.fingerprint}); {fix}"
    )


def run(args: argparse.Namespace) -> int:
    """Profile (or read a profile), solve, print the plan in words and the comparison, write the JSON."""
    if args.profile is not None:
        prof = read_profile(args.profile)  # the solver reads nothing else; MODEL, if given, is only checked
        _check_loop(args, prof)
        if args.model is not None:
            _check_model(args, prof)
    else:
        w = load_workload(args.model or DEFAULT_MODEL, args.sizes)
        with console.status(f"profiling {w.description}"):
            prof = run_profile(w.model, w.inputs, w.loss_fn, **block_options(args, w.model), **loop_options(args))
    note_high_budgets([args.budget], prof)
    chosen = make_plan(prof, args.budget, solver=args.solver)
    console.print(plan_tree(chosen))
    console.print(plans_table([make_plan(prof, strategy=none()), make_plan(prof, strategy=full()), chosen]))
    write_file(args.out, chosen.to_json())
    console.print(f"wrote {args.out}; measure it with: {_measure_command(args, prof)}", highlight=False)
    console.print(_batch_note(prof), highlight=False)
    return 0


def _batch_note(prof: Profile) -> str:
    """The plan is for the profiled batch (NOTE [ Batches larger than the profiled one ] in ``remat.core.runtime``)."""
    first = prof.block_profiles[0].input_bytes if prof.block_profiles else 0
    return (
        f"the budget holds for the profiled batch ({prof.blocks[0].name} takes {format_bytes(first)} of inputs) "
        "and smaller ones: a larger batch (longer sequences, larger images) peaks above it, and the planned model "
        "warns when a block takes more; profile on the largest batch you train with"
    )


def _measure_command(args: argparse.Namespace, prof: Profile) -> str:
    """The ``remat measure`` command for the plan just written: the profile's model and loop."""
    flags = loop_flags(prof.loop)
    loop_words = flags if flags is not None else []
    if args.profile is None or args.model is not None:
        model = [args.model or DEFAULT_MODEL, *(f"--set={item}" for item in args.sizes)]
        command = shlex.join(["remat", "measure", *model, "--plan", str(args.out), *loop_words])
        notes = []
    else:
        command = shlex.join(["remat", "measure", "MODEL", "--plan", str(args.out), *loop_words])
        notes = [f"MODEL: the model (and --set sizes) {args.profile} was profiled on, a {prof.model}"]
    if flags is None:
        notes.append(f"--optimizer has no name for {prof.loop.optimizer}, the optimizer the profile's loop steps")
    return command + (f" ({'; '.join(notes)})" if notes else "")
