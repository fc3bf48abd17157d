"""The operations of a plan and their JSON form: the vocabulary every stage shares.

A plan (``remat.plan``) is a sequence of operations over the blocks ``0..n-1`` of a chain
(NOTE [ Chain cost model ] in ``remat.plan.chain``): ``Keep``, ``Recompute`` (a segment under one
checkpoint, with its inner plan for the replay), ``RecomputeSub`` (a block with some sub-modules
checkpointed) and ``RecomputeOps`` (a block under an op-level policy: the outputs of some of its
operations are kept, every other operation runs again in the backward). The runtime (``remat.core.runtime``) installs them; the profile installs them to time
checkpointed blocks; the planner produces them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from remat._json import Reader
from remat.errors import RematError


@dataclass(frozen=True)
class Keep:
    """Block ``index`` runs normally and autograd keeps what it saves."""

    index: int

    def __repr__(self) -> str:
        return f"K{self.index}"


@dataclass(frozen=True)
class Recompute:
    """Blocks ``start..stop-1`` run under one checkpoint; recomputed in the backward under ``inner``."""

    start: int
    stop: int
    inner: tuple[Op, ...]

    def __repr__(self) -> str:
        return f"R[{self.start}:{self.stop}]({' '.join(map(repr, self.inner))})"


@dataclass(frozen=True)
class RecomputeSub:
    """Block ``index`` runs normally except its sub-modules ``fqns``, each checkpointed on its own."""

    index: int
    fqns: tuple[str, ...]

    def __repr__(self) -> str:
        return f"S{self.index}{{{','.join(self.fqns)}}}"


@dataclass(frozen=True)
class RecomputeOps:
    """Block ``index`` runs under an op-level policy (NOTE [ Op-level policies ] in ``remat.core.selective``).

    Attributes:
        index: The block.
        save: Keys (``"<op>#<occurrence>"``, e.g. ``"addmm#1"``) of the operations whose outputs are kept;
            every other operation of the block's forward runs again in its backward.
        recompute: Keys of the operations whose saved outputs are recomputed instead (for display).
    """

    index: int
    save: tuple[str, ...]
    recompute: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"O{self.index}{{{','.join(self.recompute)}|{','.join(self.save)}}}"


Op = Keep | Recompute | RecomputeSub | RecomputeOps


def ops_repr(ops: tuple[Op, ...]) -> str:
    """Compact text of a plan, e.g. ``'K0 R[1:4](K1 R[2:3](K2) K3) K4'``."""
    return " ".join(map(repr, ops))


def ops_to_json(ops: tuple[Op, ...]) -> list[Any]:
    """Operations as plain JSON values."""
    out: list[Any] = []
    for op in ops:
        if isinstance(op, Keep):
            out.append({"op": "keep", "index": op.index})
        elif isinstance(op, Recompute):
            out.append({"op": "recompute", "start": op.start, "stop": op.stop, "inner": ops_to_json(op.inner)})
        elif isinstance(op, RecomputeSub):
            out.append({"op": "recompute_sub", "index": op.index, "fqns": list(op.fqns)})
        else:
            out.append(
                {"op": "recompute_ops", "index": op.index, "save": list(op.save), "recompute": list(op.recompute)}
            )
    return out


def ops_from_json(data: Any, reader: Reader | None = None, path: str = "ops") -> tuple[Op, ...]:
    """Inverse of :func:`ops_to_json`; only the form is checked here, :func:`validate_ops` checks the coverage.

    Args:
        data: The JSON list of operations.
        reader: The file being read (default: a plan file), for messages.
        path: Where ``data`` is in the file, for messages.

    Raises:
        RematError: If an operation is not an object, has an unknown ``op``, or lacks or mistypes a field.
    """
    reader = reader or Reader("plan")
    if not isinstance(data, list):
        raise reader.error(path, "is not a list, expected a list of operations")
    ops: list[Op] = []
    for i, item in enumerate(data):
        at = f"{path}[{i}]"
        obj = reader.object(item, at)
        kind = obj.get("op")
        if kind not in _OP_FIELDS:
            raise reader.error(f"{at}.op", f"is {kind!r}, expected one of {', '.join(map(repr, _OP_FIELDS))}")
        reader.ignore_unknown(obj, {"op", *_OP_FIELDS[kind]}, at)
        if kind == "keep":
            ops.append(Keep(reader.field(obj, "index", int, at)))
        elif kind == "recompute":
            if "inner" not in obj:
                raise reader.missing(f"{at}.inner")
            start, stop = reader.field(obj, "start", int, at), reader.field(obj, "stop", int, at)
            ops.append(Recompute(start, stop, ops_from_json(obj["inner"], reader, f"{at}.inner")))
        elif kind == "recompute_sub":
            ops.append(
                RecomputeSub(reader.field(obj, "index", int, at), reader.field(obj, "fqns", tuple[str, ...], at))
            )
        else:
            ops.append(
                RecomputeOps(
                    reader.field(obj, "index", int, at),
                    reader.field(obj, "save", tuple[str, ...], at),
                    reader.field(obj, "recompute", tuple[str, ...], at),
                )
            )
    return tuple(ops)


# The fields of each operation's JSON form (besides "op"), in the order ops_to_json writes them.
_OP_FIELDS: dict[str, tuple[str, ...]] = {
    "keep": ("index",),
    "recompute": ("start", "stop", "inner"),
    "recompute_sub": ("index", "fqns"),
    "recompute_ops": ("index", "save", "recompute"),
}


def validate_ops(
    ops: Sequence[Op],
    n: int,
    *,
    block_fqns: Sequence[Sequence[str]] | None = None,
    source: str = "plan",
) -> None:
    """Check that ``ops`` is a plan for blocks ``0..n-1`` (NOTE [ Chain cost model ]).

    The operations must cover every block exactly once, in order, within ``0..n-1``; the inner plan
    of each ``Recompute`` must cover its span the same way and end with a ``Keep`` or
    ``RecomputeSub`` (the segment's output is kept); and, when ``block_fqns`` is given, the
    sub-modules of each ``RecomputeSub`` must lie inside its block.

    Args:
        ops: The operations.
        n: Number of blocks of the plan.
        block_fqns: The member modules' FQNs of each block (``Block.fqns``), to check ``RecomputeSub``.
        source: Where the check is made, the start of each message (``"apply"``, ``"plan json"`` ...).

    Raises:
        RematError: Naming the first operation at fault, its position and what was expected.
    """
    if block_fqns is not None and len(block_fqns) != n:
        raise RematError(f"{source}: a plan of {n} blocks was given the names of {len(block_fqns)} blocks")
    _validate(tuple(ops), 0, n, "plan", source, block_fqns)


def _validate(
    ops: tuple[Op, ...], start: int, stop: int, where: str, source: str, block_fqns: Sequence[Sequence[str]] | None
) -> None:
    """Raise unless ``ops`` covers blocks ``start..stop-1`` once each, in order."""
    expected = start
    for pos, op in enumerate(ops):
        if expected >= stop and isinstance(op, (Keep, RecomputeSub, RecomputeOps, Recompute)):
            raise RematError(
                f"{source}: {where} operation {op!r} at position {pos} is past block {stop - 1}, the last one it "
                f"may cover; a plan must cover blocks {start}..{stop - 1} once each, in order."
            )
        if isinstance(op, RecomputeOps) and where != "plan":
            raise RematError(
                f"{source}: {where} operation {op!r} at position {pos} puts an op-level policy inside a recomputed "
                "segment; op-level policies apply to blocks kept at the top level of a plan only: keep the block "
                f"(Keep({op.index})) or recompute it whole there."
            )
        if isinstance(op, (Keep, RecomputeSub, RecomputeOps)):
            if op.index != expected:
                raise RematError(
                    f"{source}: {where} operation {op!r} at position {pos} is for block {op.index}, expected block "
                    f"{expected}; a plan must cover blocks {start}..{stop - 1} once each, in order."
                )
            if isinstance(op, RecomputeSub) and block_fqns is not None:
                members = tuple(block_fqns[op.index])
                outside = [f for f in op.fqns if not any(f.startswith(m + ".") for m in members)]
                if outside or not op.fqns:
                    what = f"names {outside[0]!r}, which is not inside" if outside else "names no sub-module of"
                    raise RematError(
                        f"{source}: {where} operation {op!r} at position {pos} {what} block {op.index} "
                        f"({', '.join(members)}); a RecomputeSub checkpoints sub-modules of its own block."
                    )
            expected += 1
        elif isinstance(op, Recompute):
            if op.start != expected or not op.start < op.stop <= stop:
                raise RematError(
                    f"{source}: {where} operation {op!r} at position {pos} spans blocks {op.start}..{op.stop - 1}, "
                    f"expected a non-empty span starting at block {expected} and ending by block {stop - 1}; "
                    f"a plan must cover blocks {start}..{stop - 1} once each, in order."
                )
            if not op.inner or not isinstance(op.inner[-1], (Keep, RecomputeSub)):
                last = repr(op.inner[-1]) if op.inner else "nothing"
                raise RematError(
                    f"{source}: {where} operation {op!r} at position {pos} ends its inner plan with {last}; the "
                    f"inner plan of a recompute must end with Keep({op.stop - 1}) (or RecomputeSub) so the "
                    "segment's output is kept."
                )
            _validate(op.inner, op.start, op.stop, f"inner plan of {op!r}:", source, block_fqns)
            expected = op.stop
        else:
            raise RematError(
                f"{source}: {where} operation {op!r} at position {pos} is a {type(op).__name__}; "
                "expected Keep, Recompute, RecomputeSub or RecomputeOps."
            )
    if expected != stop:
        raise RematError(
            f"{source}: {where} operations cover blocks {start}..{expected - 1} but must cover {start}..{stop - 1}; "
            "add the missing blocks to the plan."
        )
