"""What the subcommands share: loading a workload, parsing sizes, printing."""

from __future__ import annotations

import ast
import importlib
import inspect
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from rich.console import Console

from remat.errors import RematError
from remat.models import WORKLOADS, Workload, workload

console = Console(highlight=False)
if not console.is_terminal:  # piped or logged: do not squeeze the tables into 80 columns
    console = Console(highlight=False, width=160)
err_console = Console(stderr=True, highlight=False)


def add_model_args(parser: ArgumentParser, *, default: str | None = "gpt") -> None:
    """``MODEL`` (a built-in name or ``module:function``) and ``--set key=value`` size overrides."""
    parser.add_argument(
        "model",
        nargs="?" if default else None,
        default=default,
        help=f"built-in model ({', '.join(WORKLOADS)}) or module:function returning a Workload or (model, inputs, loss_fn)",
    )
    parser.add_argument(
        "--set",
        dest="sizes",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a size of a built-in model, e.g. --set n_layers=12 (repeatable)",
    )


def _parse_sizes(items: list[str]) -> dict[str, Any]:
    sizes: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RematError(f"--set: cannot read {item!r}; write KEY=VALUE, e.g. --set n_layers=12")
        try:
            sizes[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            sizes[key.strip()] = value.strip()
    return sizes


def read_file(path: Path) -> str:
    """The text of a file the user named, or a RematError saying why it cannot be read."""
    try:
        return path.read_text()
    except OSError as e:
        raise RematError(f"cannot read {str(path)!r}: {e.strerror}; check the path") from None


def write_file(path: Path, text: str) -> None:
    """Write a file the user named, or raise a RematError saying why it cannot be written."""
    try:
        path.write_text(text)
    except OSError as e:
        raise RematError(f"cannot write {str(path)!r}: {e.strerror}; check that its folder exists") from None


def load_workload(spec: str, size_items: list[str]) -> Workload:
    """A built-in workload by name, or the result of calling ``module:function``.

    Raises:
        RematError: If the name is unknown, the function cannot be imported, or returns something else.
    """
    sizes = _parse_sizes(size_items)
    if ":" not in spec:
        return workload(spec, **sizes)
    mod_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise RematError(f"model: cannot import {spec!r} ({e}); give module:function on the Python path") from None
    if not callable(fn):
        raise RematError(f"model: {spec!r} is not callable; give a function returning a Workload")
    try:
        inspect.signature(fn).bind(**sizes)
    except TypeError as e:
        raise RematError(f"model: {spec} does not take {sorted(sizes)} ({e})") from None
    try:
        result = fn(**sizes)
    except Exception as e:  # the user's own factory failed: say so in one line
        raise RematError(f"model: {spec}({', '.join(f'{k}={v!r}' for k, v in sizes.items())}) raised {type(e).__name__}: {e}") from e
    if isinstance(result, Workload):
        return result
    if isinstance(result, tuple) and len(result) == 3:
        model, inputs, loss_fn = result
        return Workload(name=spec, model=model, inputs=inputs, loss_fn=loss_fn, description=spec)
    raise RematError(f"model: {spec} returned {type(result).__name__}; return a remat.models.Workload or (model, inputs, loss_fn)")
