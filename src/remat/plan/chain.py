"""The solver's view of a model: a chain of blocks with measured costs, and the operations of a plan.

# NOTE [ Chain cost model ]
A profile (``remat.profile``) measures one plain iteration of the user's training loop (NOTE [ What a
step's peak means ] in ``remat.measure.trace``) and reduces it to a chain of ``n`` blocks followed by a
*head* (index ``n``: everything after the last block, loss and the head's backward included; always
kept). All bytes are above the memory held before the iteration.

Per block ``k`` (and the head):
  ``x_bytes[k]``        bytes of the block's input (``x_bytes[n]`` is the head's input);
  ``keep_bytes[k]``     S[k]: how much the level rises over the block's forward when it runs
                        normally (saved tensors plus its output; measured, not derived);
  ``fwd_peak_bytes[k]`` fp[k]: peak rise above the level at the start of its forward;
  ``bwd_peak_bytes[k]`` bp[k]: peak rise above the level at the start of its backward;
  ``grad_bytes[k]``     G[k]: parameter gradients its backward allocates, which stay to the end of
                        the iteration (gradients set to ``None`` before it; 0 when they are held);
  ``fwd_ms[k]``, ``bwd_ms[k]``: median times.
And for the chain: ``base_bytes`` (level when block 0 starts, its input included),
``pre_peak_bytes`` (peak before block 0 starts) and ``tail_peak_bytes`` (peak rise above
``base_bytes`` after block 0's backward: the embedding's backward and its gradients, and the
optimizer step; every gradient is allocated by then, so it does not depend on the plan).

A plan is a sequence of operations over blocks ``0..n-1`` (the head is implicit and kept):
  ``Keep(k)``                   block k runs normally;
  ``Recompute(a, b, inner)``    blocks ``a..b-1`` run under one non-reentrant checkpoint: the
                                forward keeps only the segment's input and produces its output
                                (``x_bytes[b]``); in the backward the segment is recomputed under
                                ``inner`` (a plan for ``a..b-1`` whose last operation is a
                                ``Keep``), which may itself contain ``Recompute`` (nesting).
  ``RecomputeSub(k, fqns)``     block k runs normally except its sub-modules ``fqns`` (e.g. its
                                attention) which are checkpointed one by one.

Two more measured terms make any calling pattern fit this model (NOTE [ Spans ] in
``remat.apply.runtime``): ``g[k]`` (``gap_bytes``), the level change from the end of block k's forward
to the start of block k+1 (code between blocks), and what stays alive inside a block when autograd
saves nothing, ``pin[k]`` (``pinned_bytes``) and, for its output, ``pout[k]`` (``pinned_out_bytes``;
hidden states a model collects), and ``re[k]`` (``reused_bytes``), the part of block k's output that
a later block other than k+1 takes (a U-Net's skip), held even when k is inside a segment, and
``un[k]`` (``unlinked_bytes``), inputs of block k made between blocks (``x + stage(x)``), which a segment
going on through k holds as they are. A kept block holds ``S'[k] = S[k] + g[k]``; a segment ``a..b-1``
holds ``H(a, b) = x[b] + c + sum(max(g[q], 0) + pin[q] for q in a..b-1) + sum(pout[q] + re[q] for q in a..b-2)
+ sum(un[q] for q in a+1..b-1)``
(``Chain.segment_bytes``).

Memory is simulated (``remat.plan.simulate``) with a level ``L`` starting at ``base_bytes``:
  forward   Keep(k):            peak L + fp[k];  L += S'[k]
            Recompute(a, b):    peak L + c + fp[q] + (x[q] if q > a) for q in a..b-1;  L += H(a, b)
            head:               peak L + fp[n] (its backward included);  L += G[n]
  backward (reverse order)
            Keep(k):            peak L + bp[k];  L -= S'[k];  L += G[k]
            Recompute(a, b, I): forward of I from L, then backward of I (reverse), then L -= H(a, b);
                                the last block of I (always a Keep) holds S'[b-1] - out_free[b-1]
                                (the recomputed output is not kept: the replay stops once every
                                saved tensor is back, and nothing holds the output)
  after the chain:              peak base + tail_peak
(c is ``ckpt_state_bytes``, the RNG state a checkpoint keeps.) ``bp[k]`` is measured against the level
after block k's forward plus the gradients allocated before its backward starts (the head's and later
blocks'), so charging it from ``S'`` errs by ``g[k]`` on the safe side. Gradients accumulate: a
block's backward, and a recomputation, run above every gradient allocated before them (a segment's
replay runs after the blocks after it made theirs). The solvers only
put several blocks in one segment across boundaries where nothing is held between them
(``Chain.joinable``: the T5 encoder's blocks together, the decoder's together, not across): the
simulation charges any other segment exactly as above.
Time is the sum of every forward run (recomputations included) and every backward; a no-save
forward under a checkpoint costs ``ckpt_fwd_ms`` per block plus ``ckpt_call_ms`` per checkpoint call
(both measured, see NOTE [ Measured checkpoint costs ] in ``remat.profile.profiler``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from remat._json import Reader
from remat.errors import RematError

__all__ = ["Chain", "Keep", "Recompute", "RecomputeSub", "Op", "ops_repr", "ops_to_json", "ops_from_json", "validate_ops"]


@dataclass(frozen=True)
class Chain:
    """Per-block measured costs of a chain of ``n`` blocks plus the head (see NOTE [ Chain cost model ]).

    Every per-block tuple has ``n + 1`` entries; the last one describes the head.

    Attributes:
        fwd_ms: Forward time of each block, milliseconds.
        bwd_ms: Backward time of each block, milliseconds.
        x_bytes: Bytes of each block's input (entry ``n``: the head's input), bytes.
        keep_bytes: Level rise over each block's forward when it runs normally, bytes (head: 0).
        fwd_peak_bytes: Peak rise during each block's forward above the level at its start, bytes.
        bwd_peak_bytes: Peak rise during each block's backward above the level at its start, bytes.
        base_bytes: Level when block 0 starts, above the memory held before the step, bytes.
        pre_peak_bytes: Peak before block 0 starts, above the memory held before the step, bytes.
        tail_peak_bytes: Peak after block 0's backward (the rest of the backward and the optimizer
            step), above ``base_bytes``, bytes.
        out_free_bytes: Bytes of each block's output that the block does not save itself (default 0):
            when the block ends a recomputed region, torch stops the recomputation before (or frees
            right after) producing them, so they are not held during its backward.
        ckpt_fwd_ms: Cost of each block's no-save forward under a checkpoint, milliseconds (default
            ``fwd_ms``). The profile measures it so that it also carries every overhead of
            checkpointing the block (hooks, RNG state, unpacking): a block checkpointed on its own
            costs ``ckpt_call_ms + ckpt_fwd_ms + fwd_ms + bwd_ms`` in all, as measured.
        ckpt_call_ms: Fixed cost of one checkpoint call (RNG state, frame set-up), charged each time a
            ``Recompute`` runs its no-save forward, milliseconds (default 0).
        ckpt_state_bytes: Bytes each checkpoint holds from its forward to the end of its backward
            besides the segment's output: the RNG state it saves (about 5 KiB on CPU; default 0).
        gap_bytes: Level change after each block's forward and before the next block starts (code
            between blocks: a residual add, a norm), bytes (default 0; the last block's is the head's).
        pinned_bytes: Bytes allocated inside each block's forward, other than its output, that stay
            alive when autograd saves nothing (held by the model or the user: features a hook keeps),
            so recomputing the block does not free them (default 0).
        pinned_out_bytes: Bytes of each block's output that stay alive when autograd saves nothing
            (hidden states the model collects), held even when the block is inside a segment (default 0).
        reused_bytes: Bytes of each block's own output that a block other than the next one takes (a
            U-Net's skip), held even when the block is inside a segment (default 0).
        unlinked_bytes: Bytes of each block's inputs that are neither the previous block's outputs nor
            older tensors (made between blocks), held by a segment that goes on through the block (default 0).
        joinable: Whether a segment may go on from each block into the next one holding nothing that
            the chain model leaves out (``BlockProfile.chainable`` and the next block linked); the
            solvers put several blocks in one segment only across joinable boundaries (default all ``True``).
        recomputable: Whether each block may be recomputed (``False`` for a stateful forward, see
            NOTE [ State under recomputation ] in ``remat.apply.runtime``; default all ``True``).
        grad_bytes: Bytes of parameter gradients each block's backward allocates (entry ``n``: the
            head's), held from then to the end of the iteration (default 0: gradients held before it).
    """

    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    x_bytes: tuple[int, ...]
    keep_bytes: tuple[int, ...]
    fwd_peak_bytes: tuple[int, ...]
    bwd_peak_bytes: tuple[int, ...]
    base_bytes: int = 0
    pre_peak_bytes: int = 0
    tail_peak_bytes: int = 0
    out_free_bytes: tuple[int, ...] = ()
    ckpt_fwd_ms: tuple[float, ...] = ()
    ckpt_call_ms: float = 0.0
    ckpt_state_bytes: int = 0
    gap_bytes: tuple[int, ...] = ()
    pinned_bytes: tuple[int, ...] = ()
    pinned_out_bytes: tuple[int, ...] = ()
    reused_bytes: tuple[int, ...] = ()
    unlinked_bytes: tuple[int, ...] = ()
    recomputable: tuple[bool, ...] = ()
    grad_bytes: tuple[int, ...] = ()
    joinable: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not self.joinable:
            object.__setattr__(self, "joinable", (True,) * len(self.fwd_ms))
        for name in ("gap_bytes", "pinned_bytes", "pinned_out_bytes", "reused_bytes", "unlinked_bytes", "grad_bytes"):
            if not getattr(self, name):
                object.__setattr__(self, name, (0,) * len(self.fwd_ms))
        if not self.recomputable:
            object.__setattr__(self, "recomputable", (True,) * len(self.fwd_ms))
        if not self.out_free_bytes:
            object.__setattr__(self, "out_free_bytes", (0,) * len(self.fwd_ms))
        if not self.ckpt_fwd_ms:
            object.__setattr__(self, "ckpt_fwd_ms", tuple(self.fwd_ms))
        sizes = {f.name: len(getattr(self, f.name)) for f in fields(self) if isinstance(getattr(self, f.name), tuple)}
        if len(set(sizes.values())) != 1 or next(iter(sizes.values())) < 1:
            raise RematError(f"chain: per-block tuples must all have n + 1 >= 1 entries (the head last); got {sizes}")

    @property
    def n(self) -> int:
        """Number of blocks, the head excluded."""
        return len(self.fwd_ms) - 1

    def kept_level_bytes(self, k: int) -> int:
        """How much the level rises from block ``k``'s start to the next block's start when ``k`` is kept."""
        return int(self.keep_bytes[k]) + (int(self.gap_bytes[k]) if k < self.n else 0)

    def segment_bytes(self, start: int, stop: int) -> int:
        """What a segment of blocks ``start..stop-1`` holds from its forward to its backward, bytes: its
        output, one RNG state, what the code after it adds, and what stays alive inside it anyway."""
        held = int(self.x_bytes[stop]) + int(self.ckpt_state_bytes)
        for q in range(start, stop):
            # A gap that frees memory in the plain step (a frozen block's input, no longer needed) may
            # free nothing under a segment, which holds its first block's inputs: count rises only.
            held += max(0, int(self.gap_bytes[q])) if q < self.n else 0
            held += int(self.pinned_bytes[q])
            held += int(self.pinned_out_bytes[q]) + int(self.reused_bytes[q]) if q < stop - 1 else 0
            held += int(self.unlinked_bytes[q]) if q > start else 0
        return held


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


Op = Keep | Recompute | RecomputeSub


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
        else:
            out.append({"op": "recompute_sub", "index": op.index, "fqns": list(op.fqns)})
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
        else:
            ops.append(RecomputeSub(reader.field(obj, "index", int, at), reader.field(obj, "fqns", tuple[str, ...], at)))
    return tuple(ops)


# The fields of each operation's JSON form (besides "op"), in the order ops_to_json writes them.
_OP_FIELDS: dict[str, tuple[str, ...]] = {"keep": ("index",), "recompute": ("start", "stop", "inner"), "recompute_sub": ("index", "fqns")}


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
        if expected >= stop and isinstance(op, (Keep, RecomputeSub, Recompute)):
            raise RematError(
                f"{source}: {where} operation {op!r} at position {pos} is past block {stop - 1}, the last one it "
                f"may cover; a plan must cover blocks {start}..{stop - 1} once each, in order."
            )
        if isinstance(op, (Keep, RecomputeSub)):
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
                "expected Keep, Recompute or RecomputeSub."
            )
    if expected != stop:
        raise RematError(
            f"{source}: {where} operations cover blocks {start}..{expected - 1} but must cover {start}..{stop - 1}; "
            "add the missing blocks to the plan."
        )
