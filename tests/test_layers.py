"""The pipeline's import direction, read from the source: a stage imports only the ground floor and the
stages before it (profile -> plan -> apply -> measure -> report -> cli), so each can be read, changed and
tested without the ones after it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import remat

SRC = Path(remat.__file__).parent

# Lowest first. A module may import its own layer and the layers below it, never one above.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors", "units", "_json", "_progress", "_version", "blocks", "core", "models"}),  # the ground floor
    frozenset({"profile"}),
    frozenset({"plan"}),
    frozenset({"apply"}),
    frozenset({"measure"}),
    frozenset({"report"}),
    frozenset({"train", "integrations", "compiled"}),
    frozenset({"cli", "__init__", "_facade", "__main__"}),  # the public facade and the command line
)


def _unit(path: Path, root: Path) -> str:
    """The pipeline unit of a source file: its sub-package, or its module at the top."""
    rel = path.relative_to(root).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _layer(unit: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"remat.{unit} is in no layer of tests/test_layers.py: add it to LAYERS")


def _imported_units(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, unit) for every ``remat`` import in the file, function-level and TYPE_CHECKING ones included."""
    package = ("remat", *path.relative_to(root).parts[:-1])
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
                names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
                if node.module == "remat":
                    names = [f"remat.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "remat":
                out.append((node.lineno, parts[1] if len(parts) > 1 else "__init__"))
    return out


def violations(root: Path) -> list[str]:
    """Every import in the package at ``root`` that goes from a layer to a later one."""
    found = []
    for path in sorted(root.rglob("*.py")):
        unit = _unit(path, root)
        for line, target in _imported_units(path, root):
            if target != unit and _layer(target) > _layer(unit):
                found.append(f"{path.relative_to(root)}:{line} (remat.{unit}) imports remat.{target}, a later stage")
    return found


def test_stages_import_only_downward() -> None:
    assert violations(SRC) == []


def test_every_unit_has_a_layer() -> None:
    units = {_unit(p, SRC) for p in SRC.rglob("*.py")}
    for unit in units:
        _layer(unit)


@pytest.mark.parametrize(
    ("where", "line", "unit"),
    [
        ("profile/profiler.py", "from remat.apply import apply", "apply"),
        ("core/ops.py", "from remat.plan.chain import Chain", "plan"),
        ("plan/solver.py", "import remat.measure.timeline", "measure"),
        ("plan/solver.py", "from remat import report", "report"),
        ("apply/__init__.py", "from ..measure import measure", "measure"),
        ("measure/__init__.py", "def f():\n    from remat.cli import main", "cli"),
    ],
)
def test_the_check_fails_on_an_upward_import(tmp_path: Path, where: str, line: str, unit: str) -> None:
    # The same check on a copy of the package with one bad import added.
    root = tmp_path / "remat"
    for path in SRC.rglob("*.py"):
        target = root / path.relative_to(SRC)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    bad = root / where
    bad.write_text(bad.read_text() + "\n" + line + "\n")
    found = violations(root)
    assert len(found) == 1 and found[0].startswith(where) and f"imports remat.{unit}" in found[0], found
