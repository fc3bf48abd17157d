"""``remat report MODEL --budget 40%``: a self-contained HTML report and a Markdown summary."""

from __future__ import annotations

import argparse

from remat.cli.common import add_model_args
from remat.errors import RematError

HELP = "write an HTML report (plots embedded) and a Markdown summary of a model's plans"


def add_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``remat report``."""
    add_model_args(p)
    p.add_argument("--budget", required=True, help="bytes ('1.5GiB') or share of the unplanned peak ('40%%')")


def run(args: argparse.Namespace) -> int:
    """Not built yet (issue: reports)."""
    raise RematError("report: not implemented yet")
