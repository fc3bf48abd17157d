"""What the subcommands share: loading a workload, checking arguments before any measuring, printing."""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import importlib.util
import inspect
import json
import os
import sys
from argparse import ArgumentParser
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from rich.console import Console

from remat._json import write_atomic
from remat.blocks import blocks as find_blocks
from remat.core.trace import Grads, Loop
from remat.errors import RematError
from remat.models import WORKLOADS, Workload, workload
from remat.plan.strategies import STRATEGIES, Strategy, Target, parse_strategy, strategy_params
from remat.plan.types import Plan
from remat.profile.types import Profile
from remat.units import Budget, format_bytes, parse_budget

DEFAULT_MODEL = "gpt"

console = Console(highlight=False)
if not console.is_terminal and "COLUMNS" not in os.environ:  # piped or logged: do not squeeze tables into 80 columns
    console = Console(highlight=False, width=160)
err_console = Console(stderr=True, highlight=False)

# --set cannot build a torch.dtype from text, so the help does not offer it.
_NOT_SETTABLE = frozenset({"dtype"})


def _short_default(value: Any) -> str:
    if isinstance(value, tuple) and len(value) > 4:
        return f"({', '.join(map(str, value[:3]))}, ...)"
    return repr(value) if isinstance(value, str) else str(value)


def models_help() -> str:
    """The built-in models and the ``--set`` keys of each (with defaults), from :data:`remat.models.WORKLOADS`."""
    lines = ["built-in models (sizes with --set KEY=VALUE, defaults shown):"]
    for name, factory in WORKLOADS.items():
        keys = [
            f"{k}={_short_default(p.default)}"
            for k, p in inspect.signature(factory).parameters.items()
            if p.default is not inspect.Parameter.empty and k not in _NOT_SETTABLE
        ]
        head = f"  {name}{' (default)' if name == DEFAULT_MODEL else ''}: "
        lines += [
            (head if i == 0 else " " * len(head)) + line for i, line in enumerate(_wrap(keys, 90 - len(head), " "))
        ]
    lines.append("  or module:function / path/to/file.py:function returning a Workload or (model, inputs, loss_fn)")
    return "\n".join(lines)


def strategies_help() -> str:
    """The registered strategies with their parameters, from :data:`remat.plan.strategies.STRATEGIES`."""
    forms = []
    for name in STRATEGIES:
        params = ", ".join(strategy_params(name))
        forms.append(f"{name}({params})" if params else name)
    return "strategies (--strategy, e.g. 'every_nth(2)'):\n  " + ",\n  ".join(_wrap(forms, 88, ", "))


def _wrap(words: Sequence[str], width: int, sep: str) -> list[str]:
    lines: list[str] = []
    for w in words:
        if lines and len(lines[-1]) + len(sep) + len(w) <= width:
            lines[-1] += sep + w
        else:
            lines.append(w)
    return lines


def add_model_args(parser: ArgumentParser, *, default: str | None = DEFAULT_MODEL) -> None:
    """``MODEL`` (a built-in name, ``module:function`` or ``file.py:function``) and ``--set key=value`` size overrides.

    The models and their ``--set`` keys go into the parser's epilog (``--help``).
    """
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = models_help()
    parser.add_argument(
        "model",
        nargs="?" if default else None,
        default=default,
        help=f"built-in model ({', '.join(WORKLOADS)}; default {default}), module:function or path/to/file.py:function"
        if default
        else f"built-in model ({', '.join(WORKLOADS)}), module:function or path/to/file.py:function",
    )
    parser.add_argument(
        "--set",
        dest="sizes",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a size of a built-in model, e.g. --set n_layers=12 (repeatable)",
    )
    parser.add_argument(
        "--grads",
        choices=[g.value for g in Grads],
        default=Grads.NONE.value,
        help="your loop's gradients: 'none' (zero_grad() sets them to None, PyTorch's default: they are "
        "allocated in the backward) or 'held' (zeroed in place); default none",
    )
    parser.add_argument(
        "--optimizer",
        choices=list(OPTIMIZERS),
        default="none",
        help="the optimizer whose step ends your loop's iteration (its peak and state count); default none",
    )


# The optimizers --optimizer names, built on the model's parameters by the measuring functions.
OPTIMIZERS: dict[str, Any] = {
    "none": None,
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def add_split_arg(parser: ArgumentParser) -> None:
    """``--split``: profile each block's children as blocks (``remat.blocks(model, split=True)``)."""
    parser.add_argument(
        "--split",
        action="store_true",
        help="each layer's children as blocks (remat.blocks(model, split=True)): segments can then end right "
        "after a projection, recomputing only the cheap ops before it",
    )


def block_options(args: argparse.Namespace, model: torch.nn.Module) -> dict[str, Any]:
    """The ``blocks=`` keyword of ``remat.profile`` for ``args`` (``--split``), or none (the default blocks)."""
    return {"blocks": find_blocks(model, split=True)} if getattr(args, "split", False) else {}


def loop_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``grads=`` and ``optimizer=`` keywords of profile / measure / timeline / bench for ``args``."""
    return {
        "grads": getattr(args, "grads", None) or Grads.NONE.value,  # None: not given (remat plan)
        "optimizer": OPTIMIZERS[getattr(args, "optimizer", None) or "none"],
    }


def loop_of(args: argparse.Namespace) -> Loop:
    """The loop ``--grads`` / ``--optimizer`` describe, as a profile or plan records it."""
    opt = OPTIMIZERS[getattr(args, "optimizer", None) or "none"]
    return Loop(Grads(getattr(args, "grads", None) or Grads.NONE.value), opt.__name__ if opt is not None else None)


def loop_flags(loop: Loop) -> list[str] | None:
    """The ``--grads`` / ``--optimizer`` words that run ``loop`` (defaults left out), or ``None`` when
    ``--optimizer`` has no name for its optimizer (a profile made in Python with another one)."""
    names = {cls.__name__: name for name, cls in OPTIMIZERS.items() if cls is not None}
    if loop.optimizer is not None and loop.optimizer not in names:
        return None
    words = ["--grads", loop.grads.value] if loop.grads is not Grads.NONE else []
    return words + (["--optimizer", names[loop.optimizer]] if loop.optimizer is not None else [])


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
    """Write a file the user named, atomically, or raise a RematError saying why it cannot be written."""
    try:
        write_atomic(path, text)
    except IsADirectoryError:
        raise RematError(f"cannot write {str(path)!r}: this is a directory; give a file name") from None
    except OSError as e:
        raise RematError(f"cannot write {str(path)!r}: {e.strerror}; check that its folder exists") from None


def check_out_file(flag: str, path: Path | None) -> None:
    """A RematError naming ``flag`` if ``path``, a file a subcommand will write after measuring, is a
    directory or lies in a folder that does not exist: checked before minutes of measuring."""
    if path is None:
        return
    if path.is_dir():
        raise RematError(f"{flag} {str(path)!r}: this is a directory; give a file name")
    if not path.absolute().parent.is_dir():
        raise RematError(f"{flag} {str(path)!r}: its folder does not exist; create it first")


def check_positive(option: str, value: int) -> int:
    """``value`` if it is an int >= 1, else a RematError naming the option (checked before any measuring)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RematError(f"{option} {value!r}: must be an integer >= 1; e.g. {option} 5")
    return value


def check_budgets(texts: Sequence[str]) -> list[Budget]:
    """Every ``--budget`` parsed, or the first one's error (before any profiling)."""
    return [parse_budget(t) for t in texts]


def one_budget(texts: Sequence[str], what: str) -> str:
    """The one ``--budget`` of a command made for one (``what``: "a plan", "a report"), every one checked first.

    Raises:
        RematError: For a budget that does not parse, or for more than one.
    """
    check_budgets(texts)
    if len(texts) > 1:
        raise RematError(
            f"--budget given {len(texts)} times ({', '.join(map(repr, texts))}); {what} is for one budget: give "
            "one --budget, or compare several with remat bench --budget A --budget B"
        )
    return texts[0]


def parse_strategies(texts: Sequence[str]) -> list[Strategy]:
    """Every ``--strategy`` parsed and validated, with a close match for a misspelt name.

    Raises:
        RematError: For an unknown name (with "did you mean ...?" from the registry) or bad parameters.
    """
    out = []
    for text in texts:
        name = text.strip().partition("(")[0].strip()
        if name not in STRATEGIES:
            close = difflib.get_close_matches(name, list(STRATEGIES), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RematError(
                f"--strategy {text!r}: unknown strategy {name!r}; {hint}valid strategies are {', '.join(STRATEGIES)} "
                "(see remat --help)"
            )
        out.append(parse_strategy(text))
    return out


def note_high_budgets(budgets: Sequence[str], prof: Profile) -> None:
    """Say so when a budget is at or above the unplanned peak: its plan keeps every block."""
    for b in budgets:
        if parse_budget(b).resolve(prof.peak_bytes) >= prof.peak_bytes:
            console.print(
                f"[yellow]note:[/] budget {b} is at or above the unplanned peak {format_bytes(prof.peak_bytes)}: "
                "nothing needs checkpointing, its plan keeps every block; give a lower budget to save memory"
            )


def check_strategies_fit(strategies: Sequence[Strategy], model: Any) -> None:
    """Check the strategies that need no measured sizes against the model's blocks (cheap: no step runs).

    Raises:
        RematError: If a strategy names blocks the model lacks (``selective`` indices, ``named`` groups).
    """
    if not strategies:
        return
    found = Target(find_blocks(model))
    for s in strategies:
        if not s.needs_profile:
            s.ops(found)


# What writes each kind of remat JSON file, to name the right file when the user passes another one.
_WRITERS = {"profile": "remat profile", "plan": "remat plan", "measure": "remat measure", "bench": "remat bench --json"}


def _kind_of(text: str) -> str | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    if "block_profiles" in data:
        return "profile"
    if "ops" in data and "blocks" in data:
        return "plan"
    if "rows" in data:
        return "bench"
    if "forward_counts" in data:
        return "measure"
    return None


def _check_kind(option: str, path: Path, kind: str | None, want: str, fix: str) -> None:
    if kind is not None and kind != want:
        raise RematError(
            f"{option} {str(path)!r}: this is a {kind} file (from `{_WRITERS[kind]}`), not a {want}; {fix}"
        )


def read_plan(path: Path) -> Plan:
    """The plan in ``path`` (written by ``remat plan``), read before any measuring.

    Raises:
        RematError: If the file cannot be read, is another kind of remat file, or is not a valid plan.
    """
    text = read_file(path)
    kind = _kind_of(text)
    fix = (
        f"make a plan from it with `remat plan MODEL --budget 40% --profile {path}`"
        if kind == "profile"
        else "pass a plan.json written by `remat plan MODEL --budget 40%`"
    )
    _check_kind("--plan", path, kind, "plan", fix)
    return Plan.from_json(text)


def read_profile(path: Path) -> Profile:
    """The profile in ``path`` (written by ``remat profile``), read before anything else runs.

    Raises:
        RematError: If the file cannot be read, is another kind of remat file, or is not a valid profile.
    """
    text = read_file(path)
    _check_kind("--profile", path, _kind_of(text), "profile", "pass a profile.json written by `remat profile MODEL`")
    return Profile.from_json(text)


def _split_spec(spec: str) -> tuple[str, str]:
    target, _, fn_name = spec.rpartition(":")  # rpartition: a Windows path keeps its drive letter
    if not target or not fn_name:
        raise RematError(f"model: cannot read {spec!r}; write module:function or path/to/file.py:function")
    return target, fn_name


def _is_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def _no_module(spec: str, target: str, fn_name: str) -> RematError:
    path_hint = target.replace(".", "/") + ".py"
    return RematError(
        f"model: no module {target!r} (from {spec!r}) in {os.getcwd()} or on the Python path; run remat from "
        f"the folder that holds {path_hint}, or give its path: path/to/{path_hint.rsplit('/', 1)[-1]}:{fn_name}"
    )


def _search_cwd() -> None:
    # Like `python -m`, the current directory is searched for module:function; after the installed
    # packages, so that a file such as ./profile.py cannot shadow a module torch imports later.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())


def _no_function(path: str) -> RematError:
    """A ``.py`` file named without ``:function``: which functions it defines, read without running it."""
    if not Path(path).is_file():
        return RematError(
            f"model: no file {path!r} in {Path.cwd()}; check the path, and name the function that returns the "
            f"workload: {path}:function"
        )
    try:
        tree = ast.parse(Path(path).read_text(), filename=path)
        names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    except (OSError, SyntaxError, ValueError):
        names = []
    example = f"{path}:{names[0]}" if names else f"{path}:make"
    defined = f"functions defined there: {', '.join(names)}" if names else "it defines no top-level function"
    return RematError(
        f"model: {path!r} is a file; add the function in it that returns a remat.models.Workload or "
        f"(model, inputs, loss_fn), e.g. {example} ({defined})"
    )


def check_model(spec: str, size_items: list[str]) -> None:
    """Find the model without building it or running its code (checked before any measuring).

    A built-in name and its ``--set`` keys are checked against :data:`remat.models.WORKLOADS`; for
    ``path/to/file.py:function`` the file must exist; for ``module:function`` the top-level package
    must be findable (nothing is imported).

    Raises:
        RematError: Naming the model, the ``--set`` key or the path, and what to give instead.
    """
    sizes = _parse_sizes(size_items)
    if ":" not in spec:
        factory = WORKLOADS.get(spec)
        if factory is None and spec.endswith(".py"):
            raise _no_function(spec)
        if factory is None:
            close = difflib.get_close_matches(spec, list(WORKLOADS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RematError(
                f"model: unknown built-in {spec!r}; {hint}built-in models are {', '.join(WORKLOADS)}, "
                "or give module:function or path/to/file.py:function (see remat --help)"
            )
        accepted = [k for k in inspect.signature(factory).parameters if k not in _NOT_SETTABLE]
        unknown = sorted(set(sizes) - set(accepted))
        if unknown:
            raise RematError(
                f"--set: model {spec!r} has no size {', '.join(map(repr, unknown))}; its keys are {', '.join(accepted)}"
            )
        return
    target, fn_name = _split_spec(spec)
    if _is_path(target):
        if not Path(target).is_file():
            raise RematError(f"model: no file {target!r} (from {spec!r}) in {Path.cwd()}; check the path")
        return
    _search_cwd()
    try:
        found = importlib.util.find_spec(target.partition(".")[0])  # the top level only: imports nothing
    except (ImportError, ValueError):
        return  # let the real import report it
    if found is None:
        raise _no_module(spec, target, fn_name)


def _factory_module(spec: str, target: str, fn_name: str) -> ModuleType:
    """Import ``target``: a file path (``./own.py``) loaded by location, else a module name."""
    if _is_path(target):
        path = Path(target)
        if not path.is_file():
            raise RematError(f"model: no file {target!r} (from {spec!r}) in {Path.cwd()}; check the path")
        name = path.stem
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise RematError(f"model: cannot load {target!r} as Python; give a .py file, e.g. ./own.py:{fn_name}")
        module = importlib.util.module_from_spec(loader_spec)
        # As `python own.py` would: its folder on the path (for its own imports), the module registered
        # under its name (so pickling and dataclasses defined in it work).
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise RematError(
                f"model: loading {target!r} raised {type(e).__name__}: {e}; fix that file (-v for the traceback)"
            ) from e
        return module
    _search_cwd()
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is not None and (target == e.name or target.startswith(e.name + ".")):
            raise _no_module(spec, target, fn_name) from None
        raise RematError(
            f"model: importing {target!r} failed: {e}; install {e.name!r} or fix {target}'s imports"
        ) from e
    except Exception as e:  # the user's module itself failed while importing
        raise RematError(
            f"model: importing {target!r} raised {type(e).__name__}: {e}; fix that module (-v for the traceback)"
        ) from e


def load_workload(spec: str, size_items: list[str]) -> Workload:
    """A built-in workload by name, or the result of calling ``module:function`` or ``path/to/file.py:function``.

    Raises:
        RematError: If the name is unknown, the function cannot be imported, or returns something else.
    """
    check_model(spec, size_items)
    sizes = _parse_sizes(size_items)
    if ":" not in spec:
        return workload(spec, **sizes)
    target, fn_name = _split_spec(spec)
    module = _factory_module(spec, target, fn_name)
    fn = getattr(module, fn_name, None)
    if fn is None:
        here = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise RematError(
            f"model: {target!r} has no function {fn_name!r}; functions defined there: {', '.join(here) or 'none'}"
        )
    if inspect.isclass(fn) or not callable(fn):
        what = "a class" if inspect.isclass(fn) else f"a {type(fn).__name__}"
        raise RematError(
            f"model: {spec} is {what}, not a function; give a function that returns a remat.models.Workload or "
            f"(model, inputs, loss_fn), e.g. def make(): return {fn_name}(...), torch.randn(8, 16), "
            "lambda out: out.sum()"
        )
    try:
        inspect.signature(fn).bind(**sizes)
    except TypeError as e:
        given = (
            f"with {', '.join(f'{k}={v!r}' for k, v in sizes.items())} (from --set)" if sizes else "without arguments"
        )
        params = ", ".join(inspect.signature(fn).parameters) or "none"
        raise RematError(
            f"model: {spec} cannot be called {given}: {e}; its parameters are {params}: set them with "
            "--set KEY=VALUE, or give them defaults"
        ) from None
    try:
        result = fn(**sizes)
    except Exception as e:  # the user's own factory failed: say so in one line
        raise RematError(
            f"model: {spec}({', '.join(f'{k}={v!r}' for k, v in sizes.items())}) raised {type(e).__name__}: {e}"
        ) from e
    if isinstance(result, Workload):
        return result
    if isinstance(result, tuple) and len(result) == 3:
        model, inputs, loss_fn = result
        return Workload(name=spec, model=model, inputs=inputs, loss_fn=loss_fn, description=spec)
    raise RematError(
        f"model: {spec} returned {type(result).__name__}; return a remat.models.Workload or (model, inputs, loss_fn)"
    )
