"""Saved tensors edited in place between the forward and the backward.

# NOTE [ Saved tensors edited before the backward ]
Autograd checks every tensor it saves against its version counter: one edited in place between the
forward and the backward (a global, a tensor attribute that is not a buffer, a block's output that later
code edits) makes the plain backward raise "modified by an inplace operation". A recomputation reads
such a tensor again instead, edited: its gradients differed from the plain model's, silently (a global
scale doubled before ``backward()``). A tensor the forward reads without saving it (``tanh(fc(x) +
shift)``) is worse: the plain backward never looks at it and is right, the replay adds the edited shift.
So every recording of a recomputed region notes each tensor it drops in the forward, weakly, with its
version then (:func:`note_saved`: remat's span hooks, and torch's checkpoint under an op-level policy
through its determinism-check metadata), and, at the end of each call, the tensors the member's first
call read from outside (a shape-only read, ``zeros_like(t)``, is none; a tensor filled only in part is
one) (``GeneratorWatch`` in ``remat.core.runtime``, a dispatch mode on that call
only: none made by the call, none of its arguments, parameters or buffers, none an op of the call
wrote before reading); a replay first asks :func:`edited_since` of those still alive: one whose
version moved is a ``RematError`` naming the member. Arguments have their own check (autograd's,
through ``_SaveInputs``). Not seen: a tensor read without being saved that is another object on
each call than on the first (a tensor the model's code makes anew each step and hands over in an
attribute), nor one a block starts reading on a later call than its first (behind a warm-up flag).

Some in-place writes are not edits. remat's own: a nested plan's outer replay runs the inner members
again, and a member that writes into a tensor of its own before using it (a workspace, also filled
through a view: ``ws[:n] = x``) moves its version before the inner recording replays; so the version
compared is also the one the tensor had when a recording made *inside a replay* last saved it (the outer
replay's inner recording saves it again; :func:`replaying`). A save in the forward excuses nothing: a
later block reading the tensor after other code advanced it (``shift.add_(1)`` between two layers)
would otherwise excuse the edit for the earlier one. And state remat restores or checks itself:
parameters (``_swap_in_params``; FSDP2 gathers them again) and the buffers a replay puts back to their
value at the call (running statistics: NOTE [ State under recomputation ]); callers leave those out.
Any other buffer is read as it is (a mask a schedule changes before the backward is an edit). ``t.data
= other`` changes the values without a version bump: the data's address is compared too
(``t.data.add_(1)`` is still not seen). A member whose first call updates such an outside tensor from
its own values (``acc.mul_(0.9).add_(...)``: a running statistic in a plain attribute) would update it
again in every replay: ``apply`` refuses it on every call (``GeneratorWatch.updated``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch

__all__ = ["Saved", "edited_since", "note_saved", "replaying", "where_data"]

# (the tensor, weakly; its version; where its data was: ``t.data = other`` moves that without a version bump)
Saved = tuple["weakref.ref[torch.Tensor]", int, int]

# id(tensor) -> (a weak reference to it, its version when a recording last saved it).
_LAST: dict[int, Saved] = {}


def _forget(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    entry = _LAST.get(key)
    if entry is not None and entry[0] is ref:  # not a newer tensor at the same id
        del _LAST[key]


class _Replay(threading.local):
    depth = 0


_REPLAY = _Replay()


# A context manager named as the function it was.
class replaying:
    """Inside a replay (the backward's recomputation): what its recordings save is noted in ``_LAST``. A save
    in the forward is not: a later block that saves (or reads) a tensor after other code edited it must not
    excuse the edit for an earlier block (their replay would read the edited values, silently). (A class,
    not a generator: a replay leaves it through its early-stop exception, NOTE [ Context managers of a
    replay ] in ``remat.core.runtime``.)"""

    __slots__ = ()

    def __enter__(self) -> None:
        _REPLAY.depth += 1

    def __exit__(self, *exc: object) -> None:
        _REPLAY.depth -= 1


def _where(t: torch.Tensor) -> int:
    try:
        return int(t.data_ptr())
    except (RuntimeError, NotImplementedError):  # no storage (a functional tensor, a tensor subclass): versions only
        return 0


def where_data(t: torch.Tensor) -> int:
    """Where ``t``'s data is (0 where it has no storage): ``t.data = other`` moves it without a version bump;
    a recording links an argument to an earlier member's output only where it is still there (the model's
    code between them set ``h.data``: the replay handed the next member the replayed, unedited output)."""
    return _where(t)


def note_saved(t: torch.Tensor) -> Saved:
    """Note that a recording saved ``t`` now; returns what :func:`edited_since` takes."""
    key = id(t)
    ref = weakref.ref(t)
    entry = (ref, t._version, _where(t))
    if _REPLAY.depth:
        ref = weakref.ref(t, lambda r, key=key: _forget(key, r))  # type: ignore[misc]
        entry = (ref, t._version, _where(t))
        _LAST[key] = entry
    return entry


def edited_since(saved: Iterable[Saved]) -> list[torch.Tensor]:
    """The tensors of ``saved`` still alive whose version moved since the save and since any recording
    last saved them (NOTE [ Saved tensors edited before the backward ])."""
    out = []
    for ref, version, where in saved:
        t = ref()
        if t is None:
            continue
        if t._version == version:
            if _where(t) != where:
                out.append(t)  # ``t.data = ...``: other values, the same version
            continue
        last = _LAST.get(id(t))
        if last is not None and last[0]() is t and last[1] == t._version and last[2] == _where(t):
            continue  # saved again since, by a replay's recording (a nested plan)
        out.append(t)
    return out
