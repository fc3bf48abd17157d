"""Progress of long library calls (``remat.profile``, ``remat.measure``): a rich bar on a terminal, else nothing."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

Advance = Callable[[str], None]


@contextlib.contextmanager
def progress(enabled: bool | None, total: int, what: str) -> Iterator[Advance]:
    """Yield ``advance(label)``, called once per unit of ``total`` units of work.

    Args:
        enabled: ``True`` / ``False``, or ``None`` for "when standard error is a terminal".
        total: Units of work.
        what: The task's name, e.g. ``"profile"``.
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield lambda _label: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda label: bar.update(task, advance=1, description=f"{what}: {label}")
