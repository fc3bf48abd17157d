"""``remat profile MODEL``: the per-block table, written to profile.json."""

from __future__ import annotations

import argparse
from pathlib import Path

from remat.cli.common import (
    add_model_args,
    add_split_arg,
    block_options,
    check_model,
    check_out_file,
    check_positive,
    console,
    load_workload,
    loop_options,
    write_file,
)
from remat.profile import profile as run_profile
from remat.report.tables import profile_table

HELP = "measure every block of a model on its batch (bytes saved, transients, times, FLOPs)"


def add_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``remat profile``."""
    add_model_args(p)
    add_split_arg(p)
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="samples of each block's times (median; fewer plain steps where blocks have twins), default 5",
    )
    p.add_argument(
        "--out", type=Path, default=Path("profile.json"), help="where to write the profile (default profile.json)"
    )


def check(args: argparse.Namespace) -> None:
    """Every mistake that can be seen without building the model, caught before anything is measured."""
    check_positive("--repeats", args.repeats)
    check_out_file("--out", args.out)
    check_model(args.model, args.sizes)


def run(args: argparse.Namespace) -> int:
    """Profile the model, print the table, write the JSON."""
    w = load_workload(args.model, args.sizes)
    with console.status(f"profiling {w.description}"):
        prof = run_profile(
            w.model, w.inputs, w.loss_fn, repeats=args.repeats, **block_options(args, w.model), **loop_options(args)
        )
    console.print(profile_table(prof))
    write_file(args.out, prof.to_json())
    console.print(f"wrote {args.out}")
    return 0
