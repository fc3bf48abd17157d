"""The solver's view of a model: a chain of blocks with measured costs, and the operations of a plan.

# NOTE [ Chain cost model ]
A profile (``remat.profile``) measures one plain training step and reduces it to a chain of ``n``
blocks followed by a *head* (index ``n``: everything after the last block, loss and the head's
backward included; always kept). All bytes are above the memory held before the step.

Per block ``k`` (and the head):
  ``x_bytes[k]``        bytes of the block's input (``x_bytes[n]`` is the head's input);
  ``keep_bytes[k]``     S[k]: how much the level rises over the block's forward when it runs
                        normally (saved tensors plus its output; measured, not derived);
  ``fwd_peak_bytes[k]`` fp[k]: peak rise above the level at the start of its forward;
  ``bwd_peak_bytes[k]`` bp[k]: peak rise above the level at the start of its backward;
  ``fwd_ms[k]``, ``bwd_ms[k]``: median times.
And for the chain: ``base_bytes`` (level when block 0 starts, its input included),
``pre_peak_bytes`` (peak before block 0 starts) and ``tail_peak_bytes`` (peak rise above
``base_bytes`` after block 0's backward, e.g. the embedding's backward).

A plan is a sequence of operations over blocks ``0..n-1`` (the head is implicit and kept):
  ``Keep(k)``                   block k runs normally;
  ``Recompute(a, b, inner)``    blocks ``a..b-1`` run under one non-reentrant checkpoint: the
                                forward keeps only the segment's input and produces its output
                                (``x_bytes[b]``); in the backward the segment is recomputed under
                                ``inner`` (a plan for ``a..b-1`` whose last operation is a
                                ``Keep``), which may itself contain ``Recompute`` (nesting).
  ``RecomputeSub(k, fqns)``     block k runs normally except its sub-modules ``fqns`` (e.g. its
                                attention) which are checkpointed one by one.

Memory is simulated (``remat.plan.simulate``) with a level ``L`` starting at ``base_bytes``:
  forward   Keep(k):            peak L + fp[k];  L += S[k]
            Recompute(a, b):    peak L + c + fp[q] + (x[q] if q > a) for q in a..b-1;  L += x[b] + c
            head:               peak L + fp[n];  L += S[n] (0)
  backward (reverse order)
            Keep(k):            peak L + bp[k];  L -= S[k]
            Recompute(a, b, I): forward of I from L, then backward of I (reverse), then L -= x[b] + c;
                                the last block of I (always a Keep) holds S[b-1] - out_free[b-1]
                                (the recomputed output is not kept: torch stops recomputing once
                                every saved tensor is back, and nothing holds the output)
  after the chain:              peak base + tail_peak
(c is ``ckpt_state_bytes``, the RNG state a checkpoint keeps.)
Time is the sum of every forward run (recomputations included) and every backward; a no-save
forward under a checkpoint costs ``ckpt_fwd_ms`` per block plus ``ckpt_call_ms`` per checkpoint call
(both measured, see NOTE [ Measured checkpoint costs ] in ``remat.profile.profiler``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from remat.errors import RematError

__all__ = ["Chain", "Keep", "Recompute", "RecomputeSub", "Op", "ops_repr", "ops_to_json", "ops_from_json"]


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
        tail_peak_bytes: Peak after block 0's backward, above ``base_bytes``, bytes.
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

    def __post_init__(self) -> None:
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


def ops_from_json(data: list[Any]) -> tuple[Op, ...]:
    """Inverse of :func:`ops_to_json`."""
    ops: list[Op] = []
    for item in data:
        kind = item.get("op")
        if kind == "keep":
            ops.append(Keep(int(item["index"])))
        elif kind == "recompute":
            ops.append(Recompute(int(item["start"]), int(item["stop"]), ops_from_json(item["inner"])))
        elif kind == "recompute_sub":
            ops.append(RecomputeSub(int(item["index"]), tuple(item["fqns"])))
        else:
            raise RematError(f"plan json: unknown operation {kind!r}; expected keep, recompute or recompute_sub")
    return tuple(ops)
