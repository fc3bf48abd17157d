"""Executing plan operations on a live model: checkpointed segments that record and replay the model's calls.

# NOTE [ Spans ]
A ``Recompute(a, b, inner)`` covers blocks ``a..b-1``: one or more member modules that the user's own
``forward`` calls. remat leaves the model's code alone and overrides the instance ``forward`` of each
member (parameters, ``state_dict`` keys and module identity are untouched). Every member still runs
when, and as often as, the model calls it, through its own ``__call__`` (so its hooks, and FSDP2's
parameter gathering, run as usual), on the arguments the model gives it, and returns its real output.
What changes is what autograd keeps: while a member of a span runs, a saved-tensor hook of the span
(one *recording*, ``_Frame``, per forward) stores a small holder instead of each tensor autograd wants
to save, and records the call:

  * its arguments, flattened with ``torch.utils._pytree``: a tensor that is an output of an earlier
    call of the same recording (identity, and ``_version`` unchanged since) is recorded as a *link*
    to that output; any other tensor is *external*: saved through a no-op autograd function, so it
    goes through the saved-tensor hooks around it (an enclosing span drops and recomputes it:
    NOTE [ Nestable Checkpoint ] rule 2 in ``torch.utils.checkpoint``) and through torch's
    version-counter check (an in-place change before the backward raises); other values are kept
    as they are, with a shallow snapshot of mutable objects that is checked at replay;
  * the RNG state (CPU, and CUDA where the call has CUDA tensors) and autocast state at the call;
  * the values, before the call, of the buffers the member updates in place (BatchNorm's running
    statistics; see NOTE [ State under recomputation ]).

Code between two members (a residual add, a norm, a hook that edits an output, a context dict) runs
normally, outside the recording: what it saves is saved as usual, and what it hands to the next member
is an external argument, held by the span. So there is no chain restriction: any calling pattern
(keyword arguments, tuple/dict outputs, values passed from block to block, hidden states collected,
members skipped) replays exactly; a pattern only changes how much the span holds (the profile measures
that, and the planner avoids segments across such boundaries: NOTE [ Chain cost model ]).

In the backward, the first unpack of a holder replays the recording: each recorded call, in order, with
links resolved to the replayed outputs and external arguments unpacked, under the RNG, autocast,
backend-flag (NOTE [ Backend flags under recomputation ]) and buffer state of that call, through the
member's original ``forward`` (its hooks do not run again; an FSDP2 member is unsharded first). A replay hook fills the holders in the order they were packed,
checks that every recomputed tensor has the shape, dtype and device the forward saved, and stops the
replay as soon as every holder is filled (torch's early stop). A replay that saves fewer or more
tensors, or different ones, raises a ``RematError`` naming the span: never a silent difference.
Members of inner spans record again during the replay, with their own hooks innermost, exactly as in
the forward, so a nested plan drops the inner activations during the outer recomputation (rules 1-3
of torch's NOTE [ Nestable Checkpoint ]). Recorded tensors are detached (no reference cycle through
the autograd graph).

The frame and hook classes below follow torch's ``_CheckpointFrame`` / ``_checkpoint_hook`` /
``_recomputation_hook`` (holders, one replay per graph task, early stop, metadata check). remat cannot
use torch's ``checkpoint`` itself: its hooks are active over one contiguous region and its recompute
function is fixed when the region starts, while a span's members are separate calls with the model's
own code between them, and arguments that only exist once the earlier members have run.

# NOTE [ State under recomputation ]
A replay runs a member's forward again. Forwards that update a buffer in place (BatchNorm's running
statistics, spectral norm's power iteration, a custom running mean) would see the updated value and
update it a second time. The first call of a member after ``apply`` learns which of its buffers it
updates (version counters, with every buffer and tensor argument snapshotted for that call only; a
call in the other train/eval mode than the learning call learns again: an eval step may draw nothing
and update no statistics);
each later call snapshots those buffers before it runs; a replay swaps the snapshot in and the
current value back afterwards (also when the replay stops early). So state ends exactly as in the
plain model and the replay computes with the values the forward saw. This is scoped to the member's
own modules and to the thread doing the replay: no global hooks. Buffers other than a norm's running
statistics and spectral norm's vectors (``remat.core.probe.restored_buffer``) make a member *stateful*: ``apply`` refuses to recompute it unless ``allow_stateful=True``. Plain Python
attributes of its modules (ints, floats, strings, None, and small lists, tuples, sets and dicts of them:
a call counter, a step a schedule reads, ``Dropout.p``, peft's active adapter names) are recorded per
call (``_Call.modes``, with ``training``; lists as copies) and a replay sets their values at the call and
the current ones back afterwards, so it neither counts again nor computes with a later value: other code
setting one between the forward and the backward (``dropout.p = 0.5``, ``set_adapter`` between two
forwards before one backward) changed the replay's values, silently. So are the hooks its sub-modules
and the global hook dicts hold (``_Call.hooks``): a hook registered only around the forward, or added
or removed before the backward, is put as it was for the replay (its own hooks never run again; its
sub-modules' do, as under torch's checkpoint, so a hook with side effects sees the replay too, one
removed since included: a feature collector closed after the forward is called in the backward).
So are the attributes of its modules and of the plain objects they hold that other code creates, rebinds
or deletes between the call and the backward (NOTE [ Attributes other code sets ]), and so are the globals
and closure cells its code reads (NOTE [ Values a forward reads through its code ]); tensors edited in place
are refused (NOTE [ Saved tensors edited before the backward ] in
``remat.core.versions``). A member that edits one of its tensor
arguments in place is refused (its replay would edit it again). On the learning call a refusal puts
back every buffer, argument and the RNG state first.
Random draws follow the same scheme. The default generators' states are recorded per call (above):
the CPU state at a recording's first call, and again only at a call before which the model's own code
drew random numbers (a dropout between blocks); a call that finds the state where the previous call
left it keeps no copy, and its replay goes on from where the previous call's replay left the
generator (``_Frame.end_rng``, the state's bytes; the profile charges a copy per such call, ``BlockOps.fresh_rng``);
a member that draws from a generator of its own (``torch.bernoulli(p, generator=self.g)``) is found
on the learning call (a dispatch mode sees the op's ``generator`` argument), and from then on each
call keeps that generator's state too, which its replay sets, putting the generator back to where it
was afterwards. A generator a member first draws from on a later call than its first in the same
train/eval mode is not seen. An
op-level policy (torch's selective checkpoint restores the default generators only) refuses such a
member on its first call; the profile offers none for it. Python's ``random`` and numpy's global
generator are compared before and after a member's first call (50 us), and every call after, if that
one drew from them: such a call keeps their states, which its replay sets, putting them back
afterwards (an op-level policy refuses such a member). A member that first draws from them on a later
call is not seen, as for its own generators.
"""

from __future__ import annotations

import collections
import contextlib
import dis
import functools
import io
import itertools
import operator
import os
import random
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.modules import module as module_globals
from torch.nn.modules.batchnorm import _NormBase
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from remat.blocks import count_trainable
from remat.core.ops import Keep, Op, Recompute, RecomputeOps, RecomputeSub
from remat.core.probe import held_storages, made_since, restored_buffer, same_values, sequence_mark, storages
from remat.core.selective import run_selective, saves_recorded, stop_passing
from remat.core.tree import flatten, leaves, output_leaves, unflatten
from remat.core.versions import Saved, edited_since, note_saved, replaying, where_data
from remat.core.wrapped import unwrap
from remat.errors import RematError, RematWarning, higher_order_refused
from remat.units import format_bytes, format_bytes_apart

__all__ = [
    "side_written",
    "install",
    "uninstall",
    "attach",
    "detach",
    "attached",
    "suspended",
    "nested_plans",
    "count_forwards",
    "observed",
    "run_function",
    "is_applied_module",
    "GeneratorWatch",
]

Observer = Callable[[nn.Module, bool, bool], None]

_fresh_gids = itertools.count(-2, -1)


class _Local(threading.local):
    counts: dict[int, int] | None = None
    entries: int = 0  # recorded calls and replays started in this thread (NOTE [ Draws of other threads ])
    observer: Observer | None = None
    # id(span) -> (its open recording, weakly; the member position last recorded; the recording itself while
    # nothing of the graph holds it: _frame_for)
    scope: dict[int, tuple[weakref.ref[_Frame], int, _Frame | None]] | None = None
    # The CPU RNG state of the last recorded call, weakly: the recordings that keep it hold it, and
    # nothing else may (the last segment's state would outlive its backward, 5 KiB the chain model
    # does not count).
    last_rng: weakref.ref[torch.Tensor] | None = None
    # The bytes of that state while ``last_rng`` is set (NOTE [ RNG states compared as bytes ]).
    last_rng_bytes: bytes | None = None
    # Whether the backward running the current replay records a graph (NOTE [ Buffers of a replay under
    # create_graph ]).
    create_graph: bool = False


_LOCAL = _Local()


# NOTE [ Ops that fill a saved argument ]
# Autograd saves an op's tensor arguments before the kernel runs. Most ops only read them, but a few fill a
# tensor they are given and do not return, and save it for their backward: ``F.rrelu`` makes
# ``noise = empty_like(x)`` and calls ``rrelu_with_noise(x, noise, ...)``, which saves ``noise`` (and ``x``)
# and then draws the slopes into it. A replay that stops as soon as the last holder is filled (torch's early
# stop) stops before that kernel, and the backward reads ``noise`` unfilled: uninitialised memory, silently
# (``torch.utils.checkpoint`` over an RReLU alone does just that). The learning call of a member notes such an
# op on a tensor the call made (``GeneratorWatch.fills_made``, by the op's schema: a written argument no output
# aliases; BatchNorm's running statistics are buffers, not made by the call, and stay out); a replay whose last
# holder belongs to such a member runs that member's call to its end before it stops
# (``_Frame.stop_after_call``): more of the replay than an early stop, only for these members. Torch's
# selective checkpoint, which runs op-level policies, stops the same way and cannot be told otherwise per
# op: the per-op profile notes such a block (``BlockOps.fills_saved``), the planner offers it no policy, and
# a policy written by hand for one is refused on its first call (``_run_policy``).


class _Stop(Exception):
    """Raised by the replay hook once every holder of a recording is filled (torch's early stop).

    An ``Exception``, as torch's own ``_StopRecomputationError``: model code between the op that saves and
    the replay may clean up in ``except Exception:`` (a nesting counter, a flag put back before re-raising),
    which must run as it does for any other error, or the next calls, replays included, run in the state
    it left (a ``BaseException`` skipped it: gradients silently off). A handler that wraps it in an error of
    its own (einx, which x-transformers uses for its masks, re-raises every failure of an op as
    ``CallOperationError ... from e``) is recognised through the chain (``_stopped``)."""


def _stopped(e: BaseException) -> bool:
    """Whether ``e`` is, or was raised while handling, the replay's :class:`_Stop`."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, _Stop):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


class _Handle:
    pass


class _Holder:
    """What autograd stores instead of a saved tensor: one handle per graph task that replayed it."""

    def __init__(self) -> None:
        self.handles: dict[int, _Handle | None] = {}


class _Span:
    """One recomputed region of a plan: its name (first member's FQN) and its number of member calls."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size


@dataclass(eq=False)
class _Role:
    """How remat runs one module: the spans it belongs to (outermost first) and its position in each."""

    spans: tuple[tuple[_Span, int], ...]
    previous_forward: Any  # an instance ``forward`` the module had before remat, or None
    name: str
    allow_stateful: bool = False
    allow_hooks: bool = False  # NOTE [ Saved-tensor hooks around the forward ]
    learned: bool = False
    learned_training: bool = True  # the module's train/eval mode on the learning call: another mode learns again
    stateful: frozenset[str] = frozenset()
    norms: frozenset[str] | None = None
    policy: frozenset[str] | None = None  # RecomputeOps: keys of the ops whose outputs are kept
    generators: tuple[torch.Generator, ...] = ()  # its own generators, learned (NOTE [ State under recomputation ])
    # Where its parameters live, (sub-module, name): each call records the tensors there (NOTE [ Parameters
    # under recomputation ]); None until the first call; no check at all on a model sharded by FSDP2.
    param_slots: tuple[tuple[nn.Module, str], ...] | None = None
    check_params: bool = True
    root: Any = None  # a weak reference to the model: sharded by FSDP2 after apply, its parameters move
    py_rng: bool = False  # its first call drew from Python's or numpy's global generator
    # Its first call ran an op that fills a tensor the call made through an argument it does not return
    # (``rrelu_with_noise``'s noise): a replay must not stop inside it (NOTE [ Ops that fill a saved argument ]).
    fills_saved: bool = False
    # The plain attributes (ints, floats, strings ...) of its modules that its first call changed: a call
    # counter, a step read by a schedule (NOTE [ State under recomputation ]).
    attrs: tuple[tuple[nn.Module, str], ...] = ()
    # Where its modules' plain attributes are, (sub-module, name), found on its first call: each call
    # records their values there (_plain_attrs), a few microseconds instead of a walk over every attribute.
    plain_names: tuple[tuple[nn.Module, str], ...] | None = None
    # (id of one of its modules' __dict__, name) of the plain tensor attributes there -> whether the first call
    # that found a tensor there read it (kept strongly) or not (a cache it only writes: kept weakly; NOTE
    # [ Tensor attributes a block only writes ]).
    tensor_reads: dict[tuple[int, str], bool] = field(default_factory=dict)
    # The tensors its learning call read that it neither made nor was given (a global, a tensor attribute
    # that is not a buffer), weakly: each call notes their versions (NOTE [ Saved tensors edited before the
    # backward ] in remat.core.versions).
    reads: tuple[weakref.ref[torch.Tensor], ...] = ()
    # (id of a plain object's __dict__, name) of the tensors there its learning call read, and of every name
    # there at that call: each later call keeps the others weakly (NOTE [ Attributes other code sets ]).
    object_reads: frozenset[tuple[int, str]] | None = None
    object_names: frozenset[tuple[int, str]] = frozenset()
    # (id of a slotted object, slot) its learning call rebound itself: a counter, left alone (NOTE [ Containers
    # and slots of plain objects ]).
    slots_written: frozenset[tuple[int, str]] = frozenset()
    # Where its code reads globals, closure cells and a partial's containers, found on its first call (NOTE
    # [ Values a forward reads through its code ]); None until then.
    code_slots: _CodeSlots | None = None
    code_written: frozenset[int] = frozenset()  # ids of the lists and dicts there its learning call edited itself
    # The keys of its forward (pre-)hooks remat has seen: those at install and those it watches since (NOTE
    # [ Hooks added after apply ]).
    hook_keys: set[int] = field(default_factory=set)
    # The plan's check of a block's input bytes, on the first member of a block of a plan made from a
    # profile (NOTE [ Batches larger than the profiled one ]).
    size_check: SizeCheck | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # Learned again after loading.
        state["learned"], state["stateful"], state["norms"], state["generators"] = False, frozenset(), None, ()
        state["param_slots"], state["py_rng"], state["attrs"], state["plain_names"] = None, False, (), None
        state["root"], state["reads"], state["object_reads"], state["object_names"] = None, (), None, frozenset()
        state["tensor_reads"], state["slots_written"], state["code_slots"] = {}, frozenset(), None
        state["code_written"] = frozenset()
        return state


def _original(module: nn.Module, role: _Role | None) -> Callable[..., Any]:
    if role is None:
        return module.forward
    return role.previous_forward if role.previous_forward is not None else type(module).forward.__get__(module)


def _gid() -> int:
    gid = int(torch._C._current_graph_task_id())
    return gid if gid != -1 else next(_fresh_gids)


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.device)


class _SaveInputs(torch.autograd.Function):
    """Saves a call's external tensors as autograd saved tensors (hooks and version check apply)."""

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(*tensors)
        return torch.empty((0,), device=dummy.device)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - its output feeds nothing
        raise RuntimeError("remat: internal error, the saved-inputs node was run backward")


_PRIMITIVES = (
    int,
    float,
    bool,
    str,
    bytes,
    complex,
    type(None),
    torch.dtype,
    torch.device,
    torch.memory_format,
    torch.layout,
)

# Argument slots of a recorded call.
_LINK, _EXT, _OBJ = 0, 1, 2


_MISSING = object()


# NOTE [ Attributes a forward sets ]
# The learning call records every attribute of the member's modules, so that what the call changes is
# found (``_attrs_changed``): a plain value it sets (a counter), and since helper-114 also a plain tensor
# or a small list, tuple or dict of tensors and plain values it binds or edits (``self.ema = 0.9 *
# self.ema + ...``, ``self.hist = self.hist[-2:] + [h]``) and an attribute it creates (``self.step =
# getattr(self, "step", 0) + 1``, ``if not hasattr(self, "ema")``). Before, only plain values present
# before the first call were seen: a replay read the value the forward had left, a later step's counter
# or average, and computed other gradients, silently (every gradient off on both; a history's length
# read in a segment of two blocks: 14 of 48). Lists and dicts are kept as copies. Each later call keeps
# the values at the call of the attributes found (``_Role.attrs``), and a replay sets them (an attribute
# absent at the call is removed for it), then puts the current ones back. Each call also keeps the plain
# tensors its own modules hold at the call (``_plain_attrs``), which other code may rebind before the
# backward (the model's ``layer.extra = x.mean()`` after the call: every gradient off before). A tensor
# so kept is held from the call to the segment's backward, where the plain step may free it when it is
# rebound; a cache the block only writes (``self.last = y``), which was so held once per recomputed call
# and charged nowhere, is kept weakly: NOTE [ Tensor attributes a block only writes ].
# An attribute first set after the member's first call, by it or by other code, and the attributes of
# objects that are not modules (``self.state.gain``): NOTE [ Attributes other code sets ].
_OTHER = object()  # a learning call's entry for an attribute whose value it does not keep (a module's anchor)


def _kept_value(name: str, value: Any) -> bool:
    """Whether a replay sets ``value`` back (NOTE [ Attributes a forward sets ]): a primitive, a plain tensor
    that is no parameter, or a small list, tuple or dict of them (a history ``self.hist = self.hist[-2:] + [h]``)."""
    if name == "training" or name in _MODULE_INTERNALS:
        return False
    if _single(value):
        return True
    if type(value) in (list, tuple) and len(value) <= 64:
        return all(_single(v) for v in value)
    if type(value) is dict and len(value) <= 64:
        return all(isinstance(k, _PRIMITIVES) and _single(v) for k, v in value.items())
    return False


def _single(value: Any) -> bool:
    return isinstance(value, _PRIMITIVES) or (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter))


def _at_call(value: Any) -> Any:
    """``value`` as a replay sets it: a list or dict as a copy (the call or later code may edit it in place)."""
    return value.copy() if type(value) in (list, dict) else value


def _attr_values(module: nn.Module, role: _Role) -> tuple[tuple[nn.Module, str, Any], ...]:
    """The values of ``role.attrs``; on the learning call, every attribute of ``module``'s modules (its value
    where a replay sets it back, else ``_OTHER``: NOTE [ Attributes a forward sets ])."""
    if role.learned:
        return tuple((sub, name, _kept_at_call(sub, name, role)) for sub, name in role.attrs)
    return tuple(
        (sub, name, _at_call(value) if _kept_value(name, value) else _OTHER)
        for sub in module.modules()
        for name, value in vars(sub).items()
    )


def _kept_at_call(sub: nn.Module, name: str, role: _Role) -> Any:
    """The value of ``sub.name`` as a later call keeps it: a tensor the block only writes weakly (NOTE [ Tensor
    attributes a block only writes ])."""
    value = sub.__dict__.get(name, _MISSING)
    if type(value) is torch.Tensor and role.tensor_reads.get((id(sub.__dict__), name)) is False:
        return _Weak(value)
    return _at_call(value)


def _same_value(now: Any, value: Any) -> bool:
    """Whether an attribute still holds ``value``: the same object, an equal primitive (NaN equals NaN), or
    a container of the same items (tensors by identity)."""
    if now is value:
        return True
    if type(now) is not type(value):
        return False
    if isinstance(value, _PRIMITIVES):
        return bool(now == value or now != now and value != value)
    if type(value) in (list, tuple):
        return len(now) == len(value) and all(_same_value(a, b) for a, b in zip(now, value))
    if type(value) is dict:
        return now.keys() == value.keys() and all(_same_value(now[k], value[k]) for k in value)
    return False


def _attrs_changed(before: tuple[tuple[nn.Module, str, Any], ...]) -> tuple[tuple[nn.Module, str, Any], ...]:
    """The entries of ``before`` whose attribute now holds another value (``_same_value``), and where
    ``before`` is a learning call's, the attributes set since (with ``_MISSING``)."""
    out = []
    names: dict[int, tuple[nn.Module, set[str]]] = {}
    for sub, name, value in before:
        names.setdefault(id(sub), (sub, set()))[1].add(name)
        if value is not _OTHER and not _same_value(sub.__dict__.get(name, _MISSING), value):
            out.append((sub, name, value))
    for sub, known in names.values():
        if "training" not in known:  # a later call's values: no record of every attribute
            continue
        out.extend(
            (sub, name, _MISSING) for name, now in vars(sub).items() if name not in known and _kept_value(name, now)
        )
    return tuple(out)


# NOTE [ Context managers of a replay ]
# A replay enters about ten context managers per recorded call (bindings, autocast, backend flags, plain
# attributes, hooks, requires_grad, modes; around the whole replay, saved-tensor hooks, grad mode and
# ``replaying``), and leaves them through the exception of torch's early stop (``_Stop``), raised inside
# the last member's forward. Written as generators (``contextlib.contextmanager``), each costs a
# generator and, on the way out, a ``throw`` into it: about a tenth of a small block's recomputation on
# this project's CPU. They are classes here, with what they set and put back unchanged; those with
# nothing to set (no attribute, hook, flag or mode differs from the call's) do nothing on the way out.


class _AttrsAs:
    """Sets attributes to their recorded values for a replay, and puts the current ones back after. A list
    or dict is set as a fresh copy: what the replay appends (an aux loss, with the replay's graph) must not
    stay in the call's record (NOTE [ Attributes a forward sets ], NOTE [ Context managers of a replay ])."""

    __slots__ = ("recorded", "now")

    def __init__(self, recorded: tuple[tuple[nn.Module, str, Any], ...]) -> None:
        self.recorded = recorded
        self.now: list[tuple[nn.Module, str, Any]] = []

    def __enter__(self) -> None:
        self.now = [(sub, name, sub.__dict__.get(name, _MISSING)) for sub, name, _ in self.recorded]
        for sub, name, value in self.recorded:
            if type(value) is _Weak:  # NOTE [ Tensor attributes a block only writes ]
                value = value.get(name, _OF_MODULE)
            if value is _MISSING:
                sub.__dict__.pop(name, None)
            else:
                sub.__dict__[name] = _at_call(value)

    def __exit__(self, *exc: object) -> None:
        for sub, name, value in self.now:
            if value is _MISSING:
                sub.__dict__.pop(name, None)
            else:
                sub.__dict__[name] = value


# nn.Module's own bookkeeping (hook dicts, registries): never a plain attribute a forward reads.
_MODULE_INTERNALS = frozenset(vars(nn.Module()).keys()) - {"training"}


_CONTAINERS = (list, tuple, set, frozenset)


def _plain(value: Any) -> bool:
    """Whether ``value`` is a plain value a replay sets back: a primitive, or a small list, tuple, set or dict
    of primitives (peft's active adapter names)."""
    if isinstance(value, _PRIMITIVES):
        return True
    if isinstance(value, _CONTAINERS) and len(value) <= 64:
        return all(isinstance(v, _PRIMITIVES) for v in value)
    if isinstance(value, dict) and len(value) <= 64:
        return all(isinstance(k, _PRIMITIVES) and isinstance(v, _PRIMITIVES) for k, v in value.items())
    return False


def _plain_attrs(module: nn.Module, role: _Role | None) -> tuple[tuple[nn.Module, str, Any], ...]:
    """Every plain attribute of ``module``'s modules (``training`` included), and of the modules they refer
    to without owning them (a back-reference ``self.owner``, set through ``object.__setattr__``: the
    forward may read the model's step counter there), with its value at the call, for the replay (NOTE
    [ State under recomputation ]); mutable containers as copies (an in-place edit after the call would
    reach a reference). Where they are is found once per role (``_Role.plain_names``): an attribute first
    set after the module's first call is kept by ``_dicts_at`` (NOTE [ Attributes other code sets ])."""
    if role is None or role.plain_names is None or not role.learned:  # a learning call finds them again
        own = list(module.modules())
        refs: dict[int, nn.Module] = {}
        for sub in own:
            refs.update((id(v), v) for v in sub.__dict__.values() if isinstance(v, nn.Module))
        for sub in own:
            refs.pop(id(sub), None)
        # Of its own modules, the mutable containers only (copies: an in-place edit after the call would reach
        # the snapshot's reference); their other values, plain or tensors (NOTE [ Attributes a forward sets ]),
        # are bound back from the call's ``__dict__`` copies (NOTE [ Attributes other code sets ]), as are the
        # small lists and dicts of tensors they hold, copied here too (``layer.scales["g"] = h.mean()`` by the
        # model after the call edits the dict the replay reads).
        names = tuple(
            (sub, name)
            for sub in own
            for name, value in sub.__dict__.items()
            if name not in _MODULE_INTERNALS
            and type(value) in (list, set, dict)
            and (_plain(value) or _kept_value(name, value))
        )
        names += tuple(
            (sub, name)
            for sub in refs.values()
            for name, value in sub.__dict__.items()
            if name not in _MODULE_INTERNALS and _plain(value)
        )
        if role is not None:
            role.plain_names = names
    else:
        names = role.plain_names
    out: list[tuple[nn.Module, str, Any]] = []
    for sub, name in names:
        value = sub.__dict__.get(name, _MISSING)
        if value is _MISSING or isinstance(value, (*_PRIMITIVES, torch.Tensor)):
            out.append((sub, name, value))
        elif _plain(value):
            out.append((sub, name, value.copy() if isinstance(value, (list, set, dict)) else value))
        elif type(value) in (list, dict) and _kept_value(name, value):
            out.append((sub, name, value.copy()))  # of tensors: NOTE [ Attributes other code sets ]
    return tuple(out)


# The hook dicts of a module and the global ones that Module.__call__ reads (NOTE [ State under recomputation ]).
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_GLOBAL_HOOKS = tuple(getattr(torch.nn.modules.module, f"_global{name}", None) for name in _HOOK_DICTS)


# NOTE [ One walk per call ]
# A call records, and a replay reads, several things about a member's modules: their buffers (the
# state guard, the buffer slots), their parameters (``requires_grad``), their hook dicts, their
# ``__dict__`` (``_BindingsKept``). Each used to walk the module tree on its own (``named_buffers()``,
# ``parameters()``, ``modules()``: four walks per call, three per replay, 30-60 us of a small block's
# 1 ms). Nothing between them changes the tree, so one walk per call (``_Tree``) serves them all, read
# at the same moment as before. It is not kept from one call to the next: a module added or replaced
# since (a lazily built sub-module) is seen as before.
class _Tree:
    """The modules of one member at one call, walked once (NOTE [ One walk per call ])."""

    __slots__ = ("module", "named", "_dicts", "pending")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.named = list(module.named_modules())
        self._dicts: _Dicts | None = None
        # Tensor attributes of its modules no call of its role has decided on yet, by (id of the __dict__, name)
        # (NOTE [ Tensor attributes a block only writes ]); set with ``_dicts``.
        self.pending: dict[tuple[int, str], torch.Tensor] = {}

    def dicts(self, role: _Role | None) -> _Dicts:
        """The attributes of its modules and of the plain objects they hold at this moment, once per call
        (NOTE [ Attributes other code sets ])."""
        if self._dicts is None:
            self._dicts = _dicts_at(self.modules(), role, self.pending)
        return self._dicts

    def modules(self) -> list[nn.Module]:
        """``module.modules()``."""
        return [sub for _, sub in self.named]

    def _members(self, slot: str) -> list[tuple[str, torch.Tensor]]:
        # nn.Module._named_members over the walk: each tensor once, under its first name.
        seen: set[int] = set()
        out: list[tuple[str, torch.Tensor]] = []
        for prefix, sub in self.named:
            for name, t in getattr(sub, slot).items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                out.append((f"{prefix}.{name}" if prefix else name, t))
        return out

    def named_buffers(self) -> dict[str, torch.Tensor]:
        """``dict(module.named_buffers())``."""
        if type(self.module).named_buffers is not nn.Module.named_buffers:  # a class of its own: ask it
            return dict(self.module.named_buffers())
        return dict(self._members("_buffers"))

    def parameters(self) -> list[torch.Tensor]:
        """``list(module.parameters())``."""
        if type(self.module).named_parameters is not nn.Module.named_parameters:
            return list(self.module.parameters())
        seen: set[int] = set()
        out: list[torch.Tensor] = []
        for _, sub in self.named:
            for p in sub._parameters.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out


def _hook_dicts(tree: _Tree) -> list[dict[Any, Any]]:
    """The hook dicts a replay of ``tree.module`` reads: its sub-modules' (its own hooks do not run again) and the
    global ones."""
    out = [d for d in _GLOBAL_HOOKS if isinstance(d, dict)]
    for _, sub in itertools.islice(tree.named, 1, None):
        own = sub.__dict__
        out += [own[name] for name in _HOOK_DICTS if name in own]
    return out


def _hooks_at(tree: _Tree) -> tuple[tuple[dict[Any, Any], tuple[Any, ...]], ...]:
    """The hooks registered at the call, as (dict, items) for each hook dict that holds any."""
    return tuple((d, tuple(d.items())) for d in _hook_dicts(tree) if d)


class _HooksAs:
    """Puts the hooks registered at the call back for a replay (one added or removed since would change
    what the replay computes), and the current ones back after (NOTE [ Context managers of a replay ])."""

    __slots__ = ("tree", "recorded", "now")

    def __init__(self, tree: _Tree, recorded: tuple[tuple[dict[Any, Any], tuple[Any, ...]], ...]) -> None:
        self.tree, self.recorded = tree, recorded
        self.now: list[tuple[dict[Any, Any], tuple[Any, ...]]] = []

    def __enter__(self) -> None:
        if _hooks_at(self.tree) == self.recorded:
            return
        then = {id(d): items for d, items in self.recorded}
        self.now = [(d, tuple(d.items())) for d in _hook_dicts(self.tree)]
        for d, _ in self.now:
            d.clear()
            d.update(then.get(id(d), ()))

    def __exit__(self, *exc: object) -> None:
        for d, items in self.now:
            d.clear()
            d.update(items)


class _RequiresGradAs:
    """Sets the parameters' ``requires_grad`` to the recorded flags for a replay, and back after (NOTE
    [ Context managers of a replay ])."""

    __slots__ = ("recorded", "changed")

    def __init__(self, recorded: tuple[tuple[torch.Tensor, bool], ...]) -> None:
        self.recorded = recorded
        self.changed: list[tuple[torch.Tensor, bool]] = []

    def __enter__(self) -> None:
        self.changed = [(p, p.requires_grad) for p, flag in self.recorded if p.requires_grad != flag and p.is_leaf]
        for p, now in self.changed:
            p.requires_grad_(not now)

    def __exit__(self, *exc: object) -> None:
        for p, now in self.changed:
            p.requires_grad_(now)


class _Snapshot:
    """What a mutable argument holds when a block is called (NOTE [ Arguments changed before the replay ])."""

    __slots__ = ("attrs", "tensors", "containers", "nested")

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.attrs = attrs
        self.tensors: list[tuple[torch.Tensor, int]] = []
        self.containers: list[tuple[Any, list[Any]]] = []  # a list or dict, and the items it held
        self.nested: list[tuple[Any, _Snapshot]] = []

    def same(self, value: Any) -> bool:
        try:
            now = vars(value)
        except TypeError:
            return True
        return (
            now.keys() == self.attrs.keys()
            and all(now[k] is v for k, v in self.attrs.items())
            and all(t._version == version for t, version in self.tensors)
            and all(
                len(c) == len(held) and all(a is b for a, b in zip(_contents(c), held)) for c, held in self.containers
            )
            and all(snap.same(obj) for obj, snap in self.nested)
        )


# NOTE [ Arguments changed before the replay ]
# A replay calls a block again with the objects it was called with (a state object, a KV cache).
# If one of them changed since the call, by other code or by the block itself (an HF DynamicCache
# the layer appends its keys to: the replay would append them again, to the cache the model returned),
# the replay would compute with other inputs or change the object once more. A snapshot taken at the
# call holds the identity of each attribute, the version of each tensor among them, the items of
# each list or dict among them, and, two levels down, the same of the objects they hold (a cache's
# layer objects); the replay checks it and refuses with a RematError when anything differs.
_SNAPSHOT_DEPTH = 2
_SNAPSHOT_ITEMS = 256  # items of a list or dict looked into (all are compared by identity)


_CHANGED = "an attribute set, an item added, or a tensor in it edited in place"


def _cache_hint(value: Any) -> str:
    name = type(value).__name__
    return "; a KV cache: train with use_cache=False, as HF's own checkpointing does" if "Cache" in name else ""


def _contents(container: Any) -> list[Any]:
    return list(container.values()) if isinstance(container, dict) else list(container)


def _snapshot(obj: Any, depth: int = _SNAPSHOT_DEPTH) -> _Snapshot | None:
    # A snapshot of a mutable argument (NOTE [ Arguments changed before the replay ]).
    if isinstance(obj, _PRIMITIVES) or isinstance(obj, (nn.Module, type, torch.Tensor)) or callable(obj):
        return None
    try:
        attrs = dict(vars(obj))
    except Exception:  # no __dict__ (TypeError), or a __getattr__ that raises for it (KeyError, RecursionError)
        return None
    snap = _Snapshot(attrs)
    for value in attrs.values():
        _note(value, depth, snap, 0)
    return snap


def _note(value: Any, depth: int, snap: _Snapshot, nesting: int) -> None:
    if isinstance(value, torch.Tensor):
        snap.tensors.append((value, value._version))
    elif isinstance(value, (list, dict)):
        items = _contents(value)
        snap.containers.append((value, items))
        if nesting < 2:
            for item in items[:_SNAPSHOT_ITEMS]:
                _note(item, depth, snap, nesting + 1)
    elif isinstance(value, tuple):
        if nesting < 2:
            for item in value[:_SNAPSHOT_ITEMS]:
                _note(item, depth, snap, nesting + 1)
    elif depth > 0:
        inner = _snapshot(value, depth - 1)
        if inner is not None:
            snap.nested.append((value, inner))


@dataclass(eq=False)
class _RngState:
    cpu: torch.Tensor | None  # None: where the previous call of the recording left it (no draw in between)
    cuda: dict[int, torch.Tensor] = field(default_factory=dict)
    # The member's own generators (``torch.bernoulli(p, generator=self.g)``): id -> (generator, state).
    generators: dict[int, tuple[torch.Generator, torch.Tensor]] = field(default_factory=dict)

    def set(self) -> None:
        """Put every generator this state covers back to it."""
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        for dev, st in self.cuda.items():
            torch.cuda.set_rng_state(st, dev)
        for gen, st in self.generators.values():
            gen.set_state(st)


def _default_generators() -> set[int]:
    found = {id(torch.default_generator)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        found |= {id(g) for g in torch.cuda.default_generators}
    return found


class GeneratorWatch(TorchDispatchMode):
    """Finds the generators other than the default ones that ops draw from, with each one's state before
    its first draw (the learning call of NOTE [ State under recomputation ]), and the tensors the call
    reads that it neither made nor was given (NOTE [ Saved tensors edited before the backward ] in
    ``remat.core.versions``): none of ``known`` (its arguments, parameters and buffers), none that an op
    of the call wrote before reading (a workspace it fills)."""

    def __init__(self, known: Iterable[torch.Tensor] = (), buffers: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        # The member's buffers: known (never an update the call makes, NOTE [ State under recomputation ]
        # handles those), but one it reads before writing is a read too: the replay reads it as it is then,
        # unless it restores it (_Call.state).
        self.buffers = {id(b) for b in buffers}
        self.defaults = _default_generators()
        self.found: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self.known = {id(t) for t in known}
        self.made: dict[int, weakref.ref[torch.Tensor]] = {}
        self.reads: dict[int, weakref.ref[torch.Tensor]] = {}
        # A view the call made of a tensor from outside (``ws.narrow(0, 0, n)``, ``ws[:n]``): id -> (the view,
        # that tensor), weakly. Taking the view reads nothing; the view's first use decides: written (a
        # workspace the call fills through a view) or read.
        self.views: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = {}
        # Outside tensors the call took a view of, not decided yet: reads unless a write decides first
        # (a view returned unused still carries the tensor's values out of the call).
        self.pending: dict[int, weakref.ref[torch.Tensor]] = {}
        # Outside tensors an op of the call updated in place from their own values (``acc.add_(...)``,
        # ``ema.lerp_(...)``): a replay would update them a second time.
        self.updated: dict[int, weakref.ref[torch.Tensor]] = {}
        # Outside tensors the call filled only part of (read: the rest keeps the values from outside).
        self.partial: dict[int, weakref.ref[torch.Tensor]] = {}
        # Parts of outside tensors the call overwrote whole through a view (``ws[:n].copy_(x)``,
        # ``ws.narrow(0, 0, n).zero_()``), by (storage offset, shape, strides): later uses of that same part
        # read or update the call's own values, not the outside tensor's.
        self.filled: dict[int, set[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
        # An op filled a tensor the call made through an argument it does not return (NOTE [ Ops that fill
        # a saved argument ]).
        self.fills_made = False

    @property
    def all_reads(self) -> tuple[weakref.ref[torch.Tensor], ...]:
        """The reads, with the tensors the call only took views of and never wrote through one."""
        rest = [
            ref
            for key, ref in {**self.pending, **self.partial}.items()
            if key not in self.known and key not in self.reads
        ]
        return (*self.reads.values(), *rest)

    def _root(self, t: torch.Tensor) -> torch.Tensor | None:
        entry = self.views.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1]()

    def _decide(self, t: torch.Tensor, written: bool, overwrites: bool = True, whole: bool = True) -> None:
        if written and id(t) not in self.known and (not overwrites or id(t) in self.reads):
            # Updated from its own values: in place (``acc.add_``), or read first and then overwritten
            # (``ema.copy_(0.9 * ema + ...)``): a replay reads the updated values and updates it again.
            self.updated.setdefault(id(t), weakref.ref(t))
        if id(t) in self.known or id(t) in self.reads:
            return
        if written and overwrites and not whole:
            # A fill of only part of it (``mem[:n] = x``, ``masked_fill_``): the rest of its values are the
            # outside tensor's, read by whatever reads it next.
            self.partial.setdefault(id(t), weakref.ref(t))
        elif written and not overwrites:
            self.reads[id(t)] = weakref.ref(t)
        elif written:
            self.known.add(id(t))  # filled by the call before any read: not an input
        else:
            self.reads[id(t)] = weakref.ref(t)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and id(gen) not in self.defaults and id(gen) not in self.found:
            self.found[id(gen)] = (gen, gen.get_state())
        written = _written(func, args, kwargs)
        if not self.fills_made and written:
            side = side_written(func, args, kwargs)
            self.fills_made = any(
                (made := self.made.get(id(t))) is not None and made() is t
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and id(t) in side
            )
        # An out= variant that reads what it writes (``torch.add(acc, s, out=acc)``) updates it, as ``acc.add_(s)``.
        read_too = _read_args(func, args, kwargs) & written if written else set()
        overwrites = _overwrites(func)
        view = bool(getattr(func, "is_view", False)) and not written
        roots: list[torch.Tensor] = []  # what the view this op makes is a view of (outside tensors)
        if _metadata_only(func):  # ``torch.zeros_like(ws)``: its values are not read
            out = func(*args, **kwargs)
            for t in tree_leaves(out):  # but what it makes is the call's own (x.new_zeros(n).scatter_add_(...))
                if isinstance(t, torch.Tensor):
                    self.made[id(t)] = weakref.ref(t)
            return out
        for t in tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor):
                continue
            made = self.made.get(id(t))
            if made is not None and made() is t:
                root = self._root(t)
                if root is not None:
                    if view:
                        roots.append(root)
                    else:
                        region = (int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))
                        if region in self.filled.get(id(root), ()):
                            continue  # the part of it the call filled itself
                        whole = root.numel() == t.numel() and not _partial(func)
                        if (
                            id(t) in written
                            and overwrites
                            and id(t) not in read_too
                            and not whole
                            and not _partial(func)
                            and id(root) not in self.known
                            and id(root) not in self.reads
                        ):
                            # A part filled whole before any read of it: the call's own from here on.
                            self.filled.setdefault(id(root), set()).add(region)
                            self.pending.pop(id(root), None)
                            continue
                        self._decide(root, id(t) in written, overwrites and id(t) not in read_too, whole)
                continue
            if id(t) in self.buffers and id(t) not in self.reads and id(t) not in written and not view:
                self.buffers.discard(id(t))
                self.reads[id(t)] = weakref.ref(t)
            elif id(t) in self.buffers and (id(t) in written or view):
                self.buffers.discard(id(t))  # written first (or through a view: on the safe side, not a read)
            if id(t) in self.known or id(t) in self.reads:
                if id(t) in self.reads and id(t) in written:
                    self._decide(t, True, overwrites and id(t) not in read_too)  # read before: updated
                continue
            if view:
                roots.append(t)
                self.pending.setdefault(id(t), weakref.ref(t))
            else:
                self._decide(t, id(t) in written, overwrites and id(t) not in read_too, not _partial(func))
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made[id(t)] = weakref.ref(t)
                if roots:
                    self.views[id(t)] = (weakref.ref(t), weakref.ref(roots[0]))
        return out


# In-place ops whose written argument's old values they do not read (a fill, a copy into it, a draw): a
# tensor from outside the call such an op writes first is a workspace the call fills, not state it updates.
_OVERWRITING = frozenset(
    {
        "copy_",
        "fill_",
        "zero_",
        "normal_",
        "uniform_",
        "bernoulli_",
        "random_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
        "index_put_",
        "_index_put_impl_",
        "masked_fill_",
        "index_fill_",
        "index_copy_",
        "masked_scatter_",
        "set_",
        "resize_",
        "resize_as_",
    }
)


# Of those, the ones that write only some of its elements (a mask, indices): the others keep the values the
# tensor had, which the call reads from outside.
_PARTIAL = frozenset(
    {"index_put_", "_index_put_impl_", "masked_fill_", "index_fill_", "index_copy_", "masked_scatter_"}
)


def _partial(func: Any) -> bool:
    packet = getattr(func, "overloadpacket", None)
    return getattr(packet, "__name__", "") in _PARTIAL


# Ops that read only the shape, dtype and device of their tensor arguments.
_METADATA_ONLY = frozenset(
    {
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_zeros",
        "new_ones",
        "new_full",
        "new_empty_strided",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
    }
)


def _metadata_only(func: Any) -> bool:
    packet = getattr(func, "overloadpacket", None)
    return getattr(packet, "__name__", "") in _METADATA_ONLY


def _overwrites(func: Any) -> bool:
    """Whether ``func`` writes without reading what it writes (``_OVERWRITING``; an ``out=`` variant)."""
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet, "__name__", "")
    overload = getattr(func, "_overloadname", "")
    return name in _OVERWRITING or "out" in overload


def _updated_error(name: str, t: torch.Tensor) -> RematError:
    return RematError(
        f"apply: module {name!r} updates in place, from its own values, a tensor that is none of its arguments, "
        f"parameters or buffers (shape {tuple(t.shape)}, {t.dtype}: a running statistic or counter kept in a plain "
        "tensor attribute or a global, acc.add_(...), ema.lerp_(...)), so its recomputation in the backward would "
        "update it a second time and compute with the twice-updated values; register it as a buffer, assign a new "
        "tensor instead of updating in place (self.acc = self.acc * 0.9 + ...), or keep this block (a plan that "
        "does not recompute it)"
    )


def _written(func: Any, args: Sequence[Any], kwargs: dict[str, Any], *, write: bool = True) -> set[int]:
    """Ids of the tensors an op writes into (in-place ops, ``out=``), from its schema; with ``write=False``,
    of those it takes as arguments it does not write into."""
    out: set[int] = set()
    try:
        arguments = func._schema.arguments
    except AttributeError:
        return out
    for i, arg in enumerate(arguments):
        alias = arg.alias_info
        if (alias is not None and alias.is_write) != write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor):
                out.add(id(t))
    return out


def _read_args(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> set[int]:
    """Ids of the tensors an op takes as arguments it does not write into."""
    return _written(func, args, kwargs, write=False)


def side_written(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> set[int]:
    """Ids of the tensors an op writes into through an argument that none of its outputs aliases
    (``rrelu_with_noise``'s ``noise``), not as an in-place op (``add_``) or an ``out=`` variant, which return
    what they write (NOTE [ Ops that fill a saved argument ])."""
    try:
        arguments = func._schema.arguments
        returned = {a for r in func._schema.returns if r.alias_info is not None for a in r.alias_info.before_set}
    except AttributeError:
        return set()
    out: set[int] = set()
    for i, arg in enumerate(arguments):
        alias = arg.alias_info
        if alias is None or not alias.is_write or set(alias.before_set) & returned:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out.update(id(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return out


# NOTE [ RNG states compared as bytes ]
# A recording compares the CPU RNG state at a member's call with the state at the end of the call before
# (``_Frame.end_rng``), and each call's state with the last recorded call's (``_rng_state``). Holding the
# end state as a tensor would hold 5 KiB of torch memory per open recording, which the chain model does
# not count; a BLAKE2b digest of it took 20 us per call on this project's CPU, twice per member of a
# multi-member segment. A copy of its bytes (Python memory, which the torch profiler does not see, as in
# NOTE [ Buffer copies outside the trace ] in remat.core.probe) costs 2 us, and comparing two of them is
# exact (no digest collision to reason about).
def _state_bytes(state: torch.Tensor) -> bytes:
    """The bytes of a CPU RNG state (a uint8 tensor), outside torch's memory."""
    return state.numpy().tobytes()


def _rng_state(leaves: Sequence[Any], generators: Sequence[torch.Generator] = ()) -> tuple[_RngState, bytes]:
    """The RNG state at a call, and the bytes of its CPU state (NOTE [ RNG states compared as bytes ])."""
    cpu = torch.get_rng_state()
    data = _state_bytes(cpu)
    last = _LOCAL.last_rng() if _LOCAL.last_rng is not None else None
    if last is not None and data == _LOCAL.last_rng_bytes:  # NOTE [ RNG states compared as bytes ]
        cpu = last  # no draws since the previous call: share one copy
    _LOCAL.last_rng, _LOCAL.last_rng_bytes = weakref.ref(cpu), data
    cuda: dict[int, torch.Tensor] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
                index = leaf.device.index if leaf.device.index is not None else torch.cuda.current_device()
                if index not in cuda:
                    cuda[index] = torch.cuda.get_rng_state(index)
    # A generator handed to the call (``block(x, generator=g)``, often a fresh one per step) is the call's
    # too: the learned ones (``_Role.generators``) are the learning call's objects only, so a later call's
    # replay drew from that step's generator where the forward had left it (gradients off from the second
    # step on, silently, helper-71).
    given = [leaf for leaf in leaves if isinstance(leaf, torch.Generator)]
    return _RngState(cpu, cuda, {id(g): (g, g.get_state()) for g in (*generators, *given)}), data


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    out = []
    for dev in ("cpu", "cuda"):
        if dev == "cuda" and not torch.cuda.is_available():
            continue
        out.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
    return tuple(out)


# NOTE [ Backend flags under recomputation ]
# Flags that choose kernels, and so the values a forward computes and the tensors it saves: an
# ``sdpa_kernel(...)`` or ``torch.backends.mkldnn.flags(...)`` block around the forward only (the
# backward outside it) is a common training-loop pattern. torch's checkpoint replays under the flags
# of the backward; remat records them per call (about 15 C getters, 2 us) and a replay (or an
# op-level policy's recomputation) sets those that differ, putting them back afterwards. Getters and
# setters that this torch does not have are skipped.
_FLAGS: tuple[tuple[Callable[[], Any], Callable[[Any], None]], ...] = tuple(
    (getattr(torch._C, f"_get_{get}"), getattr(torch._C, f"_set_{put}"))
    for get, put in (
        ("mkldnn_enabled", "mkldnn_enabled"),
        ("mkldnn_deterministic", "mkldnn_deterministic"),
        ("flash_sdp_enabled", "sdp_use_flash"),
        ("mem_efficient_sdp_enabled", "sdp_use_mem_efficient"),
        ("math_sdp_enabled", "sdp_use_math"),
        ("cudnn_sdp_enabled", "sdp_use_cudnn"),
        ("overrideable_sdp_enabled", "sdp_use_overrideable"),
        ("sdp_priority_order", "sdp_priority_order"),
        ("math_sdp_allow_fp16_bf16_reduction", "math_sdp_allow_fp16_bf16_reduction"),
        ("cudnn_enabled", "cudnn_enabled"),
        ("cudnn_deterministic", "cudnn_deterministic"),
        ("cudnn_allow_tf32", "cudnn_allow_tf32"),
        ("cublas_allow_tf32", "cublas_allow_tf32"),
        ("float32_matmul_precision", "float32_matmul_precision"),
    )
    if hasattr(torch._C, f"_get_{get}") and hasattr(torch._C, f"_set_{put}")
) + (
    # Global modes a forward's code may branch on or that change what ops make (not per backend): a
    # ``use_deterministic_algorithms(True)`` (its kernels; code reading ``are_deterministic_algorithms_enabled``),
    # ``set_default_dtype`` (``torch.tensor(0.1)``, ``torch.arange`` in a block) or ``detect_anomaly`` around
    # the forward only: replayed under the backward's, a segment's later members computed with other
    # values (gradients 0.02-1.5 off, silently, helper-71).
    (
        lambda: (torch._C._get_deterministic_algorithms(), torch._C._get_deterministic_algorithms_warn_only()),
        lambda value: torch._C._set_deterministic_algorithms(value[0], warn_only=value[1]),
    ),
    (torch.get_default_dtype, torch.set_default_dtype),
    (
        lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        lambda value: torch.set_anomaly_enabled(value[0], value[1]),
    ),
)


def _flags() -> tuple[Any, ...]:
    return tuple(get() for get, _ in _FLAGS)


class _FlagsAs:
    """Sets the backend flags that differ from ``recorded`` (NOTE [ Backend flags under recomputation ])
    for the block, and puts them back after (NOTE [ Context managers of a replay ])."""

    __slots__ = ("recorded", "now", "changed")

    def __init__(self, recorded: tuple[Any, ...]) -> None:
        self.recorded = recorded
        self.now: tuple[Any, ...] = ()
        self.changed: list[tuple[int, Any]] = []

    def __enter__(self) -> None:
        now = self.now = _flags()
        self.changed = [(i, value) for i, value in enumerate(self.recorded) if now[i] != value]
        for i, value in self.changed:
            _FLAGS[i][1](value)

    def __exit__(self, *exc: object) -> None:
        for i, _ in self.changed:
            _FLAGS[i][1](self.now[i])


class _AutocastAs:
    """The autocast state of the call, for a replay: an ``torch.autocast`` entered per device whose state at
    the call differs from the state now, or that was enabled at the call. A device disabled at the call and
    now, with the same dtype, needs none (NOTE [ Context managers of a replay ]): entering one changes
    nothing the replay computes or what stays cached (autocast casts nothing while disabled, and its cache
    is only cleared when the outermost region exits, as it then is by the region around the backward, if
    any)."""

    __slots__ = ("recorded", "stack")

    def __init__(self, recorded: tuple[tuple[str, bool, torch.dtype], ...]) -> None:
        self.recorded = recorded
        self.stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        for dev, enabled, dtype in self.recorded:
            if not enabled and not torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == dtype:
                continue
            if self.stack is None:
                self.stack = contextlib.ExitStack()
            self.stack.enter_context(torch.autocast(dev, enabled=enabled, dtype=dtype))

    def __exit__(self, *exc: Any) -> bool | None:
        return self.stack.__exit__(*exc) if self.stack is not None else None


@dataclass(eq=False)
class _Call:
    """One recorded call of a member: enough to run it again with the same inputs and state."""

    module: nn.Module
    role: _Role
    spec: Any
    slots: list[tuple[Any, ...]]
    saver: torch.Tensor | None
    rng: _RngState
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    state: dict[str, torch.Tensor]
    inner: tuple[tuple[_Span, int], ...]
    flags: tuple[Any, ...] = ()  # backend flags at the call (NOTE [ Backend flags under recomputation ])
    params: tuple[tuple[nn.Module, str, torch.Tensor, int, int], ...] = ()  # (owner, name, tensor, version, address)
    # (owner, its _buffers items) at the call (NOTE [ Parameters under recomputation ], _buffer_refs)
    buffer_slots: tuple[tuple[nn.Module, tuple[tuple[str, torch.Tensor | None], ...]], ...] = ()
    attrs: tuple[tuple[nn.Module, str, Any], ...] = ()  # (module, name, value before the call) of _Role.attrs
    py_rng: tuple[Any, Any] | None = None  # Python's and numpy's global RNG states, if the call drew from them
    # (module, "training", flag) of the member and its sub-modules at the call: a replay runs in the mode
    # the forward ran in, whatever train()/eval() was called since (a block whose modes save the same
    # tensors, noise added in training only, was replayed in the other mode, silently).
    modes: tuple[tuple[nn.Module, str, Any], ...] = ()
    # The hooks of its sub-modules and the global ones at the call (a hook added or removed between the
    # forward and the backward, or between two calls, changed the replay's values, silently).
    hooks: tuple[tuple[dict[Any, Any], tuple[Any, ...]], ...] = ()
    # (parameter, requires_grad) at the call: a parameter frozen between the forward and the backward is
    # replayed as it was (torch's AccumulateGrad then skips it, as in the plain backward); frozen in the
    # replay, its ops would save other tensors than the forward's.
    grads: tuple[tuple[torch.Tensor, bool], ...] = ()
    # The tensors of _Role.reads with their versions at the end of the call (NOTE [ Saved tensors edited
    # before the backward ] in remat.core.versions).
    reads: tuple[Saved, ...] = ()
    # The caller's dispatch modes active at the call (NOTE [ Dispatch modes around the forward ]).
    dispatch_modes: tuple[tuple[Any, ...], tuple[Any, ...]] | tuple[()] = ()
    # The bytes of the CPU RNG state at the end of a call that drew from it (NOTE [ Draws of other
    # threads ]); None: the call drew nothing.
    drew_to: bytes | None = None
    # The attributes of its modules and of the plain objects they hold, at the call, and its modules by
    # name (NOTE [ Attributes other code sets ]).
    dicts: _Dicts = ()
    named: list[tuple[str, nn.Module]] = field(default_factory=list)
    # The values its code reads through globals and closure cells at the call (NOTE [ Values a forward reads
    # through its code ]).
    code: _CodeValues | tuple[()] = ()


class _Frame:
    """One recording of a span in one forward (see NOTE [ Spans ])."""

    def __init__(self, span: _Span) -> None:
        self.span = span
        self.calls: list[_Call] = []
        self.holders: list[weakref.ref[_Holder]] = []
        self.meta: list[tuple[Any, ...]] = []
        self.owner: list[int] = []
        # Each saved tensor, weakly, with its version when saved (NOTE [ Saved tensors edited before the backward ]).
        self.versions: list[Saved] = []
        # id -> (call, leaf, the tensor, its version, made by that call: NOTE [ In-place edits of a member's output ],
        # where its data was: ``h.data = other`` between two members moves that without a version bump)
        self.outs: dict[int, tuple[int, int, weakref.ref[torch.Tensor], int, bool, int]] = {}
        self.recomputed: dict[int, weakref.WeakKeyDictionary[_Handle, torch.Tensor]] = {}
        self.counter: dict[int, int] = {}
        self.done: set[int] = set()
        # The CPU RNG state right after the last recorded call, while the recording goes on: a call that
        # finds it unchanged (no draw in the model's code between) keeps no copy; its replay goes on from
        # the state the previous call's replay leaves (NOTE [ State under recomputation ]).
        self.end_rng: bytes | None = None  # its bytes: NOTE [ RNG states compared as bytes ]
        # (call, output leaf) -> its storage, weakly, for the outputs counted as made by their call (with no
        # autograd node, by their storage: ``made_since``) that a later member edited in place (check_made).
        self.edited_outs: dict[tuple[int, int], weakref.ref[torch.UntypedStorage]] = {}
        # id -> (the tensor, weakly; its float64 sum), for the outputs of learning calls: NOTE [ Edits of a
        # member's output through .data ].
        self.out_sums: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        # The replay filled every holder inside a call that must run to its end first (NOTE [ Ops that fill a
        # saved argument ]).
        self.stop_after_call = False

    # -- forward ------------------------------------------------------------------------------

    def record(
        self,
        module: nn.Module,
        role: _Role,
        flat: list[Any],
        spec: Any,
        rng: _RngState,
        rng_bytes: bytes,
        inner: tuple[tuple[_Span, int], ...],
        tree: _Tree,
    ) -> int:
        """Record a call with arguments ``flat``/``spec`` (:func:`remat.core.tree.flatten`), its RNG state and the
        bytes of its CPU state (``_rng_state``), and its modules walked once for the call (``tree``)."""
        slots: list[tuple[Any, ...]] = []
        external: list[torch.Tensor] = []
        seen: dict[int, int] = {}  # one slot per distinct tensor: self_attn(x, x, x) replays with x three times
        for leaf in flat:
            if isinstance(leaf, torch.Tensor):
                hit = self.outs.get(id(leaf))
                if hit is not None and hit[2]() is leaf and leaf._version == hit[3] and where_data(leaf) == hit[5]:
                    self._check_unedited(leaf, hit[0], module, role)
                    slots.append((_LINK, hit[0], hit[1]))
                elif id(leaf) in seen:
                    slots.append((_EXT, seen[id(leaf)], leaf.requires_grad))
                else:
                    seen[id(leaf)] = len(external)
                    slots.append((_EXT, len(external), leaf.requires_grad))
                    external.append(leaf.detach())
            else:
                slots.append((_OBJ, leaf, _snapshot(leaf)))
        saver = None
        if external:
            dummy = torch.empty((0,), requires_grad=True)
            saver = _SaveInputs.apply(dummy, *external)
        if self.calls and self.end_rng is not None and rng.cpu is not None and rng_bytes == self.end_rng:
            rng = _RngState(None, rng.cuda, rng.generators)
        modes = _plain_attrs(module, role)
        grads = tuple((p, p.requires_grad) for p in tree.parameters())
        self.calls.append(
            _Call(
                module,
                role,
                spec,
                slots,
                saver,
                rng,
                _autocast_state(),
                {},
                inner,
                _flags(),
                modes=modes,
                hooks=_hooks_at(tree),
                grads=grads,
                dispatch_modes=_user_dispatch_modes(),
                dicts=tree.dicts(role),
                named=tree.named,
                code=_code_values(role, tree),
            )
        )
        return len(self.calls) - 1

    def _check_unedited(self, leaf: torch.Tensor, call: int, module: nn.Module, role: _Role) -> None:
        """Refuse a link to an output of a learning call whose values changed since without a version bump
        (NOTE [ Edits of a member's output through .data ])."""
        entry = self.out_sums.get(id(leaf))
        if entry is None or entry[0]() is not leaf:
            return
        now = _value_sum(leaf)
        if now is None or torch.isnan(entry[1]) or torch.equal(now, entry[1]):
            return
        raise RematError(
            f"apply: the output of module {self.calls[call].role.name!r} (shape {tuple(leaf.shape)}) was edited "
            f"before module {role.name!r} took it, through .data or another alias that autograd does not see "
            "(no version bump), so a recomputation, which hands the next module the recomputed output, would give "
            "it the values from before the edit; edit it with an in-place op on the tensor itself (x.clamp_(...), "
            "under torch.no_grad() if needed) or rebind it (x.data = x.data.clamp(...)), or keep these blocks "
            "in separate segments"
        )

    def record_output(
        self, index: int, outs: list[Any], mark: int, held: set[int] | None = None, learning: bool = False
    ) -> None:
        """Note the tensors among ``outs`` (``output_leaves`` of what call ``index`` returned) for links;
        for a ``learning`` call, also their sums (NOTE [ Edits of a member's output through .data ])."""
        for j, leaf in enumerate(outs):
            if isinstance(leaf, torch.Tensor):
                if learning and (total := _value_sum(leaf)) is not None:
                    self.out_sums[id(leaf)] = (weakref.ref(leaf), total)
                self.outs[id(leaf)] = (
                    index,
                    j,
                    weakref.ref(leaf),
                    leaf._version,
                    made_since(leaf, mark, held),
                    where_data(leaf),
                )

    def note_edited(self, t: torch.Tensor) -> None:
        """A later member edited ``t``, an output of a recorded call that made it, in place: the replay checks
        that the call makes it anew (NOTE [ In-place edits of a member's output ])."""
        hit = self.outs.get(id(t))
        if hit is None or hit[2]() is not t:
            return
        base = t._base if t._base is not None else t
        try:
            self.edited_outs[(hit[0], hit[1])] = weakref.ref(base.untyped_storage())
        except (RuntimeError, NotImplementedError):
            pass

    def check_made(self, index: int, out: Any) -> None:
        """Refuse a replayed output that a later member edits in place and that is the very storage the
        forward's call returned (state the call returns, which the replay would edit a second time)."""
        leaves = output_leaves(out)
        for (call, j), ref in self.edited_outs.items():
            if call != index or j >= len(leaves) or not isinstance(leaves[j], torch.Tensor):
                continue
            st = ref()
            leaf = leaves[j]
            base = leaf._base if leaf._base is not None else leaf
            if st is not None and base.untyped_storage() is st:
                name = self.calls[index].role.name
                raise RematError(
                    f"apply: module {name!r} returned the same tensor (output #{j}, shape {tuple(leaf.shape)}) when "
                    "recomputed as in its forward, not one it made (a tensor it keeps in its state, a cache, a "
                    "global), and a later module of the segment edits that tensor in place, so the recomputation "
                    "would edit it a second time; return a copy (t.clone()), or keep these blocks (a plan that "
                    "does not recompute them)"
                )

    def packing(self, index: int) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor hooks of call ``index`` of this recording (no generator: NOTE [ Context managers
        of a replay ])."""

        def pack(t: torch.Tensor) -> _Holder:
            holder = _Holder()
            self.holders.append(weakref.ref(holder))
            self.meta.append(_meta(t))
            self.owner.append(index)
            self.versions.append(note_saved(t))
            return holder

        return torch.autograd.graph.saved_tensors_hooks(pack, self.unpack)

    # -- backward -----------------------------------------------------------------------------

    def unpack(self, holder: _Holder) -> torch.Tensor:
        gid = _gid()
        if gid not in self.done:
            self.replay(gid)
        handle = holder.handles.get(gid)
        if handle is None or handle not in self.recomputed[gid]:
            raise RematError(
                f"apply: a tensor saved in the checkpointed segment starting at {self.span.name!r} was unpacked twice in "
                "one backward (ctx.saved_tensors read twice?); read saved tensors once per backward"
            )
        holder.handles[gid] = None
        return self.recomputed[gid].pop(handle)

    def _who(self, index: int) -> str:
        call = self.calls[self.owner[index]] if index < len(self.owner) else None
        return call.role.name if call is not None else self.span.name

    def replay(self, gid: int) -> None:
        self.counter[gid] = 0
        self.recomputed[gid] = weakref.WeakKeyDictionary()
        # The replay's own graph keeps this hook alive (saved variables hold their hooks): reach the
        # frame through a weak reference, as torch's _recomputation_hook does, or the frame would leak.
        pack = _replay_pack(weakref.ref(self), gid)
        previous_create_graph = _LOCAL.create_graph
        _LOCAL.create_graph = torch.is_grad_enabled()  # the backward's mode, before the replay enables grad
        try:
            # A backward may run under torch.inference_mode() (the plain one does): the replay records a graph.
            with (
                torch.autograd.graph.saved_tensors_hooks(pack, _identity),
                torch.inference_mode(False),
                torch.enable_grad(),
                replaying(),
            ):
                self._run_calls(self._edited_saves())
        except _Stop:
            pass
        except Exception as e:  # the model's code wrapped the stop in an error of its own (NOTE on _Stop)
            if not _stopped(e):
                _raise_if_vmapped(self.span.name, e)
                raise
            e.__cause__ = e.__context__ = e.__traceback__ = None  # hold none of the replay's frames
        finally:
            _LOCAL.create_graph = previous_create_graph
        self.done.add(gid)
        if self.counter[gid] != len(self.holders):
            raise RematError(
                f"apply: recomputing the segment starting at {self.span.name!r} saved {self.counter[gid]} tensors where "
                f"its forward saved {len(self.holders)}; the model's forward took another path when run again "
                "(Python state changed?); keep these blocks (a plan that does not recompute them)"
            )

    def _edited_saves(self) -> dict[int, torch.Tensor]:
        """The first saved tensor of each call that was edited in place since it was saved, by call index
        (NOTE [ Saved tensors edited before the backward ])."""
        edited: dict[int, torch.Tensor] = {}
        # One pass over every saved tensor first: ``_first_edited`` of an entry finds one only among those
        # ``edited_since`` returns, which is none on nearly every backward.
        if edited_since(self.versions):
            for entry, owner in zip(self.versions, self.owner):
                if owner not in edited:
                    call = self.calls[owner]
                    t = _first_edited((entry,), call.module, call.role, call.state)
                    if t is not None:
                        edited[owner] = t
        for owner, call in enumerate(self.calls):
            if call.reads and owner not in edited:
                t = _first_edited(call.reads, call.module, call.role, call.state)
                if t is not None:
                    edited[owner] = t
        return edited

    def _run_calls(self, edited: dict[int, torch.Tensor] | None = None) -> None:
        outs: dict[int, list[Any]] = {}
        previous_scope = _LOCAL.scope
        _LOCAL.scope = {}  # inner spans record afresh, as in the forward
        cuda_devices = sorted({d for call in self.calls for d in call.rng.cuda})
        # The members' own generators go back to where they are now after the replay, as fork_rng does for
        # the default ones.
        own = {key: (gen, gen.get_state()) for call in self.calls for key, (gen, _) in call.rng.generators.items()}
        # And Python's and numpy's global generators, where a member drew from them.
        py_now = _py_states() if any(call.py_rng is not None for call in self.calls) else None
        overlap = _Overlap()  # other threads' calls see this replay (NOTE [ Draws of other threads ])
        try:
            with _ForkRng(cuda_devices):
                last_use = self._last_uses()
                for index, call in enumerate(self.calls):
                    args, kwargs = self._arguments(call, outs)
                    if edited and index in edited:
                        raise _edited_error(call.role.name, edited[index])
                    call.rng.set()
                    if call.py_rng is not None:
                        _set_py_states(call.py_rng)
                    out = _replay_call(call, args, kwargs)
                    del args, kwargs
                    if call.drew_to is not None and _state_bytes(torch.get_rng_state()) != call.drew_to:
                        raise _other_draws_error(call.role.name)
                    if self.stop_after_call:
                        self.stop_after_call = False
                        raise _Stop
                    if self.edited_outs:
                        self.check_made(index, out)
                    # Hold a replayed output only while a later call takes it (as the forward did).
                    for done in [i for i, last in last_use.items() if last <= index and i in outs]:
                        del outs[done]
                    if last_use.get(index, -1) > index:
                        outs[index] = output_leaves(out)
                    del out
        finally:
            overlap.exit()
            for gen, st in own.values():
                gen.set_state(st)
            if py_now is not None:
                _set_py_states(py_now)
            _LOCAL.scope = previous_scope

    def _last_uses(self) -> dict[int, int]:
        """For each call whose output a later call takes, the last call that takes it."""
        last: dict[int, int] = {}
        for index, call in enumerate(self.calls):
            for slot in call.slots:
                if slot[0] == _LINK:
                    last[slot[1]] = index
        return last

    def _arguments(self, call: _Call, outs: dict[int, list[Any]]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        node: Any = call.saver.grad_fn if call.saver is not None else None
        try:
            external = node.saved_tensors if node is not None else ()  # unpacking runs the hooks around it
        except RuntimeError as e:
            if "modified by an inplace operation" not in str(e):
                raise
            # The input's version moved since the call (h.add_(layer(h)): the block's input edited in place
            # after it ran); the plain model's backward does not need it, the replay does.
            raise RematError(
                f"apply: an input of module {call.role.name!r} was edited in place after the call and before the "
                f"backward (an in-place residual such as h.add_(layer(h))), so its recomputation would see other "
                "values; write h = h + layer(h), or keep this block (a plan that does not recompute it) "
                f"({str(e).splitlines()[0][:120]})"
            ) from e
        leaves: list[Any] = []
        fresh: dict[int, torch.Tensor] = {}
        cast_cached = torch.is_autocast_cache_enabled() and any(enabled for _, enabled, _ in call.autocast)
        for slot in call.slots:
            if slot[0] == _LINK:
                leaves.append(outs[slot[1]][slot[2]])
            elif slot[0] == _EXT:
                if slot[1] not in fresh:
                    t = external[slot[1]].detach()
                    if slot[2]:
                        t = t.requires_grad_(True)
                        if cast_cached:
                            # NOTE [ Autocast's cached weight casts ] in remat.core.probe: autocast caches the
                            # cast of a leaf that requires grad until its outermost region exits, and the cast's
                            # graph holds the leaf: each replay would leave both behind (BERT: 36 KiB a layer).
                            # A view of the leaf is not cached, and autograd saves as from the leaf.
                            t = t.view_as(t)
                    fresh[slot[1]] = t
                leaves.append(fresh[slot[1]])
            else:
                value, snap = slot[1], slot[2]
                if snap is not None and not snap.same(value):
                    raise RematError(
                        f"apply: an argument of module {call.role.name!r} ({type(value).__name__}) was changed by the "
                        f"call or after it, before the backward ({_CHANGED}), so its recomputation would differ or "
                        "change it again; pass a fresh object per call, or keep this block (a plan that does not "
                        f"recompute it){_cache_hint(value)}"
                    )
                leaves.append(value)
        args, kwargs = unflatten(leaves, call.spec)
        return tuple(args), dict(kwargs)


def _identity(t: Any) -> Any:
    return t


class _ForkRng:
    """``torch.random.fork_rng(devices=cuda_devices)``: the CPU generator's state (and the CUDA devices')
    put back after the replay; without CUDA devices, the CPU state only, without the generator-based
    context manager (NOTE [ Context managers of a replay ])."""

    __slots__ = ("devices", "cpu", "fork")

    def __init__(self, devices: list[int]) -> None:
        self.devices = devices
        self.cpu: torch.Tensor | None = None
        self.fork: contextlib.AbstractContextManager[Any] | None = None

    def __enter__(self) -> None:
        if self.devices:
            self.fork = torch.random.fork_rng(devices=self.devices, device_type="cuda")
            self.fork.__enter__()
        else:
            self.cpu = torch.get_rng_state()

    def __exit__(self, *exc: Any) -> bool | None:
        if self.fork is not None:
            return self.fork.__exit__(*exc)
        assert self.cpu is not None
        torch.set_rng_state(self.cpu)
        return None


# NOTE [ Saved tensors edited before the backward ] in remat.core.versions.
def _edited_error(name: str, t: torch.Tensor) -> RematError:
    return RematError(
        f"apply: a tensor that module {name!r} used in its forward (shape {tuple(t.shape)}, {t.dtype}), not one of "
        "its arguments or parameters nor a buffer its replay restores, was edited in place after the forward and before the backward (a "
        "global, a tensor attribute that is not a buffer, an output edited by later code), so its recomputation "
        "would compute with other values than the forward did (where the forward saved it, the plain model's "
        "backward fails too: 'modified by an inplace operation'); edit it after the backward, or keep this "
        "block (a plan that does not recompute it)"
    )


def _fsdp_managed(module: nn.Module, role: _Role) -> bool:
    root = role.root() if role.root is not None else None
    return _is_fsdp(module) or (root is not None and _is_fsdp(root))


def _first_edited(
    saved: Iterable[Saved], module: nn.Module, role: _Role, restored: Iterable[str] = ()
) -> torch.Tensor | None:
    """The first tensor of ``saved`` edited in place since (``remat.core.versions.edited_since``), other than
    a parameter, which remat checks itself, or a buffer of ``module`` the replay puts back to its value at
    the call (``restored``: the names of ``_Call.state``, the buffers the call updates). Any other buffer
    is read by the replay as it is now: one edited since the call (a mask a schedule changes before the
    backward) is an edit."""
    edited = edited_since(saved)
    if not edited or _fsdp_managed(module, role):  # FSDP2 gathers parameters again
        return None

    named = dict(module.named_buffers())
    buffers = [named[n] for n in restored if n in named]
    for t in edited:
        base = t._base if t._base is not None else t
        if isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter):
            continue  # _swap_in_params
        if any(b is t or b is base for b in buffers):
            continue  # restored around the replay (NOTE [ State under recomputation ])
        return t
    return None


def _known(module: nn.Module, flat: Sequence[Any]) -> list[torch.Tensor]:
    """What a learning call may read without it being a read of its own (GeneratorWatch): its tensor
    arguments, its modules' parameters and buffers."""
    known = [t for t in flat if isinstance(t, torch.Tensor)]
    return known + list(module.parameters()) + list(module.buffers())


def _note_reads(role: _Role) -> tuple[Saved, ...]:
    if not role.reads:
        return ()
    return tuple(note_saved(t) for t in (ref() for ref in role.reads) if t is not None)


def _replay_pack(frame_ref: weakref.ref[_Frame], gid: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(t: torch.Tensor) -> torch.Tensor:
        # Detached: a saved output packed with its grad_fn would make a reference cycle through C++.
        t = t.detach() if t.requires_grad else t
        frame = frame_ref()
        if frame is None:  # pragma: no cover - the frame replays itself, so it is alive here
            raise RematError("apply: internal error, a segment's recording was freed during its replay")
        idx = frame.counter[gid]
        frame.counter[gid] = idx + 1
        if idx >= len(frame.holders):
            raise RematError(
                f"apply: recomputing the segment starting at {frame.span.name!r} saved more tensors than its forward; "
                "the model's forward is not a function of its inputs and state (Python state changed?); "
                "keep these blocks (a plan that does not recompute them)"
            )
        if _meta(t) != frame.meta[idx]:
            why = (
                "a jagged nested tensor, whose ragged size is a new symbol each time one is made, so a replay "
                "cannot match it; recompute such blocks one at a time, or keep them"
                if t.is_nested or any(not isinstance(d, int) for d in t.shape)
                else "the module's forward depends on something that changed since it ran (Python state, an "
                "argument edited in place, a cache); keep it (a plan that does not recompute it)"
            )
            raise RematError(
                f"apply: recomputing module {frame._who(idx)!r} (segment starting at {frame.span.name!r}) saved a "
                f"tensor of shape/dtype/device {_meta(t)} where its forward saved {frame.meta[idx]}: {why}"
            )
        holder = frame.holders[idx]()
        if holder is not None:
            handle = _Handle()
            holder.handles[gid] = handle
            frame.recomputed[gid][handle] = t
        if frame.counter[gid] == len(frame.holders):
            call = frame.calls[frame.owner[idx]]
            # NOTE [ Ops that fill a saved argument ]: the op saving this tensor has not run yet. NOTE [ Draws
            # of other threads ]: a call that drew runs to its end, where its state is known.
            if call.role.fills_saved or call.drew_to is not None:
                frame.stop_after_call = True
            else:
                raise _Stop
        return t

    return pack


def _py_states() -> tuple[Any, Any]:
    """Python's and (if imported) numpy's global RNG states: a member may draw from them too."""
    np = sys.modules.get("numpy")
    return random.getstate(), np.random.get_state() if np is not None else None


def _py_drew(before: tuple[Any, Any]) -> bool:
    py, legacy = before
    if random.getstate() != py:
        return True
    if legacy is None:
        return False
    now = sys.modules["numpy"].random.get_state()
    return bool(now[2] != legacy[2] or now[3] != legacy[3] or (now[1] != legacy[1]).any())


def _set_py_states(states: tuple[Any, Any]) -> None:
    random.setstate(states[0])
    if states[1] is not None:
        sys.modules["numpy"].random.set_state(states[1])


def _is_fsdp(module: nn.Module) -> bool:
    # By class, once per class (a module sharded after ``apply`` has a class of FSDP2's own: another entry).
    cls = type(module)
    found = _FSDP_CLASSES.get(cls)
    if found is None:
        found = _FSDP_CLASSES[cls] = any(c.__name__ == "FSDPModule" for c in cls.__mro__)
    return found


_FSDP_CLASSES: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


class _BindingsKept:
    """Put back afterwards what a recomputation binds to the attributes of ``tree.module`` and its sub-modules
    (an aux loss, a cache: ``self.aux = h.sum()``, RecurrentGemma's ``recurrent_states``): bound to the
    recomputed tensor, it would keep the recomputation's graph, and every tensor it saved, alive after it
    (1.31x the budget on an MoE aux loss, 1.30x on RecurrentGemma under an op-level policy). The items of a
    dict or list attribute the recomputation writes into (``self.store["aux"] = ...``) are put back too:
    the replay's tensor there held its graph to the next step (1.42x the budget). (A class: NOTE [ Context
    managers of a replay ].)"""

    __slots__ = ("tree", "bound", "dicts", "lists", "seen")

    def __init__(self, tree: _Tree) -> None:
        self.tree = tree
        self.bound: list[tuple[nn.Module, dict[str, Any]]] = []
        self.dicts: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
        self.lists: list[tuple[list[Any], list[Any]]] = []
        self.seen: set[int] = set()

    def _collect(self, value: Any, depth: int) -> None:
        # The containers in an attribute, and the ones in them (``self.store = {"aux": []}``, a defaultdict(list)).
        if depth > 2 or id(value) in self.seen:
            return
        if type(value) in _DICTS:
            self.seen.add(id(value))
            self.dicts.append((value, dict(value)))
            for v in list(value.values()):
                self._collect(v, depth + 1)
        elif type(value) is list:
            self.seen.add(id(value))
            self.lists.append((value, list(value)))
            for v in value:
                self._collect(v, depth + 1)

    def __enter__(self) -> None:
        self.bound = [(sub, dict(sub.__dict__)) for sub in self.tree.modules()]
        for _, before in self.bound:
            for name, value in before.items():
                if (type(value) is list or type(value) in _DICTS) and name not in _MODULE_DICTS:
                    self._collect(value, 0)

    def __exit__(self, *exc: object) -> None:
        for sub, before in self.bound:
            _restore_entries(sub.__dict__, before)
        for d, held in self.dicts:
            if not _same_items(d, held):
                d.clear()
                d.update(held)
        for seq, was in self.lists:
            if len(seq) != len(was) or any(a is not b for a, b in zip(seq, was)):
                seq[:] = was


_DICTS = (dict, collections.defaultdict, collections.OrderedDict)


def _same_items(now: dict[Any, Any], before: dict[Any, Any]) -> bool:
    """Whether ``now`` holds the very objects ``before`` holds, under the same keys in the same order (a
    comparison of identities run by C code; keys in another order count as a change, on the safe side)."""
    return (
        len(now) == len(before)
        and all(map(operator.is_, now, before))
        and all(map(operator.is_, now.values(), before.values()))
    )


# NOTE [ Attributes other code sets ]
# NOTE [ Attributes a forward sets ] keeps per call the attributes a member's modules hold at its first
# call and those the forward sets. Other code may also create, rebind or delete an attribute the forward
# reads between the call and the backward, after the first call, or on an object that is not a module:
# the model sets ``layer.extra = h.mean()`` after the block ran, absent at its first call; blocks read
# ``self.state.gain``, a tensor of a plain object the model rebinds between blocks. A replay read the
# later value and computed other gradients, silently (every gradient of a 4-block MLP off over 3 steps,
# helper-118; also an attribute of a sub-sub-module, one deleted and set again, a float on a shared
# object, one read through a property, an object held by an object, an item of a dict the block holds).
# So each call keeps a shallow copy of the ``__dict__`` of each of its modules and of the plain objects
# (not modules, tensors, containers, classes, functions or Python modules; two levels down) they hold
# (``_dicts_at``: a dict copy each, C code; a few microseconds per call for a small block, against the
# milliseconds a recorded call costs), and a replay whose dict no longer holds the very same objects
# (``_same_items``) gets the call's bindings for the replay, absent ones removed, and the current ones
# back after (``_DictsAs``). What the replay binds there is put back too: a counter on a shared object
# counts the forward's calls, as in the plain model (count replays in an object without a ``__dict__``),
# and a tensor the replay binds there does not keep its graph. The values are references: a tensor
# rebound since stays alive to the segment's backward, where the plain step may free it. On a plain
# object, where the blocks of a model often leave a cache (``self.state.last = h``, rebound by the next
# block), it cost 1.85x the prediction under ``remat.full()``: so there the tensors the member's learning
# call did not read are kept weakly (``_object_copy``), and one that died by the replay is bound as a
# stand-in that refuses any use (``_Gone``): exact or refused, never a later value. Tensors of a module,
# and those set since the learning call: NOTE [ Tensor attributes a block only writes ]. A sub-module
# replaced or removed since the call (``layer.act = nn.Tanh()``) is refused at the replay
# (``_check_tree``): its recomputation would run another module. Lists and dicts of plain objects edited in
# place, objects without a ``__dict__`` (``__slots__``) and objects three levels down: NOTE [ Containers and
# slots of plain objects ]; globals, closure cells: NOTE [ Values a forward reads through its code ].
# (an object's __dict__, its copy at the call); also (a slotted object, its slots), (a list, its copy) and (a
# dict an object holds, its copy): NOTE [ Containers and slots of plain objects ].
_Dicts = tuple[tuple[Any, Any], ...]

# Values of a module's __dict__ that are no plain object holding attributes, by type (the common ones, a
# set lookup); ``_plain_object`` decides for the rest. remat's own entries (``_Role``, and ``_Dispatch``,
# added below its class) are none.
_NOT_OBJECTS: set[type] = {
    dict,
    collections.OrderedDict,
    list,
    tuple,
    set,
    frozenset,
    torch.Tensor,
    nn.Parameter,
    _Role,
    *_PRIMITIVES,
}
# Nor a plain tensor (NOTE [ Tensor attributes a block only writes ]); remat's ``_Dispatch`` added with it below.
_PLAIN_TYPES: set[type] = _NOT_OBJECTS - {torch.Tensor}
_NO_OBJECT_TYPES = (
    nn.Module,
    torch.Tensor,
    type,
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    *_PRIMITIVES,
    *_CONTAINERS,
    dict,
)
# The entries remat and nn.Module keep in a module's __dict__ (its role and instance forward, the registries).
_OWN_ENTRIES = _MODULE_INTERNALS | {"forward", "_remat_role"}


def _plain_object(value: Any) -> dict[str, Any] | None:
    """The ``__dict__`` of ``value`` if it is a plain object whose attributes a forward may read (a state or
    config object), else None."""
    if type(value) in _NOT_OBJECTS or isinstance(value, _NO_OBJECT_TYPES):
        return None
    try:
        d = object.__getattribute__(value, "__dict__")
    except (AttributeError, TypeError):
        return None
    return d if type(d) is dict and len(d) <= 256 else None


def _dicts_at(
    modules: list[nn.Module], role: _Role | None, pending: dict[tuple[int, str], torch.Tensor] | None = None
) -> _Dicts:
    """A shallow copy of the ``__dict__`` of each of ``modules`` and of the plain objects they hold, three levels
    down, the objects' tensors that ``role``'s learning call did not read kept weakly (NOTE [ Attributes other
    code sets ]), and so the modules' tensors that no call of ``role`` read (NOTE [ Tensor attributes a block
    only writes ]): those not decided yet go to ``pending``. Also the slots of objects without a ``__dict__``
    and the small lists and dicts the objects hold (NOTE [ Containers and slots of plain objects ])."""
    out: list[tuple[Any, Any]] = []
    level = []
    for sub in modules:
        d = sub.__dict__
        if _PLAIN_TYPES.issuperset(map(type, d.values())):  # neither a plain tensor nor an object (C code)
            out.append((d, d.copy()))
            continue
        types = set(map(type, d.values()))
        out.append((d, _module_copy(d, role, pending) if torch.Tensor in types else d.copy()))
        if not _NOT_OBJECTS.issuperset(types):
            level.append(d)
    seen: set[int] = set()
    boxes: list[tuple[Any, Any]] = []
    for depth in range(_OBJECT_DEPTH):
        if not level:
            break
        found: list[tuple[Any, Any]] = []
        for d in level:
            if depth and _NOT_OBJECTS.issuperset(map(type, d.values())):  # no object in it (C code)
                continue
            for value in d.values():
                if type(value) in _NOT_OBJECTS or id(value) in seen:
                    continue
                od = _plain_object(value)
                if od is not None and id(od) not in seen:
                    seen.add(id(od))
                    found.append((od, _object_copy(od, role, pending)))
                if _slot_names(type(value)) and id(value) not in seen:
                    seen.add(id(value))  # NOTE [ Containers and slots of plain objects ]
                    found.append((value, _slots_copy(value, role, pending)))
        for _, then in found:
            if not _NO_BOXES.issuperset(map(type, then.values())):  # a list or dict in it (C code)
                boxes += _boxes(then, role, pending, seen)
        out += found
        level = [then for _, then in found]
    return (*out, *boxes)


# NOTE [ Containers and slots of plain objects ]
# NOTE [ Attributes other code sets ] kept per call a shallow copy of the ``__dict__`` of the plain objects a
# member's modules hold, two levels down. Three forms still gave a replay other values than the call, silently
# (helper-126, ``repro_patterns.py``: 82-98 of 99 outputs, gradients and parameters off over 3 SGD steps
# under ``remat.full()``, ``segments(2)``, the smallest optimal plan and split blocks): a list or dict such an
# object holds edited in place by the model's code between blocks or before the backward
# (``state.lst[0] = h.mean()``, ``state.d["k"] = ...``, ``state.scales.append(...)`` read as
# ``scales[-1]``): the copy held the same list; an object without a ``__dict__`` (``__slots__``) whose slots
# the model rebinds; an object three levels down (``state.a.b.gain``). So each call also copies the small
# lists and dicts (<= 64 items, ``_BOX_ITEMS``) those objects hold, and the slots of slotted objects, three
# levels down (``_OBJECT_DEPTH``); a replay whose list, dict or slots changed since the call gets the call's
# items for itself, in place, and the current ones back after, as for the objects' ``__dict__``s (what the
# replay appends, an aux loss, does not stay). A dict's tensors its learning call did not read are kept
# weakly, as an object's (``_object_copy``); a list's items are kept as they are (what the list holds anyway).
# Slots the member's learning call itself rebinds to a value that is no tensor are left out: an object without
# a ``__dict__`` is where a model (and remat's tests) counts replays (``self.tally.n += 1``), documented since
# helper-118; so a plain value a block both reads and rebinds in a slot is not seen (a tensor is: a running
# average in a slot is set back for the replay, as on a module). Cost: none for a
# module that holds no plain object (the type scan above); a scan of each object's values per call
# otherwise, and a copy of each small list or dict it holds.
_OBJECT_DEPTH = 3
_BOX_ITEMS = 64
_SLOTS: dict[type, tuple[str, ...]] = {}
# Values that are no list or dict (a set lookup per value, C code): an object's other values.
_NO_BOXES: set[type] = {t for t in _NOT_OBJECTS if t not in (list, dict, collections.OrderedDict)}


def _slot_names(cls: type) -> tuple[str, ...]:
    """The slots ``cls`` declares (a slotted plain object; with or without a ``__dict__``), else ()."""
    names = _SLOTS.get(cls)
    if names is None:
        names = ()
        if not issubclass(cls, _NO_OBJECT_TYPES) and not _library(cls.__module__):
            found = [vars(k).get("__slots__", ()) for k in cls.__mro__]
            names = tuple(
                n
                for slots in found
                for n in ((slots,) if isinstance(slots, str) else slots)
                if n not in ("__weakref__", "__dict__")
            )
        _SLOTS[cls] = names
    return names


def _slots_copy(obj: Any, role: _Role | None, pending: dict[tuple[int, str], torch.Tensor] | None) -> dict[str, Any]:
    """The slots of ``obj`` at the call, as ``_object_copy`` keeps an object's ``__dict__``; those the member's
    learning call rebound itself (a counter) left out (NOTE [ Containers and slots of plain objects ])."""
    written = role.slots_written if role is not None else frozenset()
    key = id(obj)
    values = {n: getattr(obj, n, _MISSING) for n in _slot_names(type(obj)) if (key, n) not in written}
    return _object_copy(values, role, pending, key)


def _boxes(then: dict[str, Any], role: _Role | None, pending: Any, seen: set[int]) -> list[tuple[Any, Any]]:
    """The small lists and dicts among an object's values, each with a copy (NOTE [ Containers and slots of
    plain objects ])."""
    out: list[tuple[Any, Any]] = []
    for value in then.values():
        kind = type(value)
        if (kind is list or kind is dict or kind is collections.OrderedDict) and id(value) not in seen:
            if len(value) <= _BOX_ITEMS:
                seen.add(id(value))
                out.append((value, value.copy() if kind is list else _object_copy(value, role, pending)))
    return out


# NOTE [ Tensor attributes a block only writes ]
# NOTE [ Attributes a forward sets ] and [ Attributes other code sets ] keep per call the tensors a
# member's modules (and the plain objects they hold) bind at the call, for the replay. A cache the block
# only writes (``self.last_h = fc1(x)``, never read) was so held by every recomputed call from the call to
# its segment's backward, where the plain step frees it at the call, when the forward rebinds it: one
# intermediate per recomputed block that the profile does not charge (helper-118: 6 x 262,144 B under
# ``remat.full()`` on a 6-block MLP, all 6 of the previous step's caches alive after the forward; the
# CPU profiler of ``remat.measure`` misses it, since it sees no free of a tensor allocated before the
# step; with every free seen the step peaked 1,572,864 B higher than without the hold; on CUDA
# ``max_memory_allocated`` sees it). So such a tensor is kept only as the first call that finds it decides:
# the learning call from its read set (``_Role.reads``), a later one, where a name was absent or held no
# tensor at the learning call (a cache the forward creates, an average it creates lazily), under
# ``_ReadWatch``, a dispatch mode that notes whether any op takes it (one call per name and role; the
# tensor is kept strongly for that call). Read: kept strongly by every later call (an average ``self.ema
# = 0.9 * self.ema + ...`` stays exact). Not read: kept weakly (``_Weak``): it is the very tensor the call
# saw while anything else holds it, and one that died by the replay is bound as ``_Gone``, which refuses
# any use with a RematError (a block that reads it only on some calls): exact or refused, never another
# value. Charging the hold in the profile instead would have needed a per-block term through the profile,
# the chain, the solver's tables and the simulation, for memory that keeping it weakly does not use. Cost:
# none where no module holds a plain tensor (the type scan of each module's ``__dict__`` that looked for
# plain objects tells it, ``_PLAIN_TYPES``); else a loop over that ``__dict__`` per call (``_module_copy``).
class _Weak:
    """A tensor a call keeps weakly: one its member's learning call did not read (NOTE [ Attributes other code
    sets ], NOTE [ Tensor attributes a block only writes ])."""

    __slots__ = ("ref",)

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)

    def get(self, name: str, owner: str) -> Any:
        """The tensor, or a stand-in that refuses any use if it died."""
        t = self.ref()
        return t if t is not None else _Gone(name, owner)


_OF_OBJECT = "a plain object a block's modules hold"
_OF_MODULE = "a module of a block"


class _Gone:
    """Bound for a replay in place of a tensor kept weakly that died since the call: any use raises. It passes
    ``isinstance(value, torch.Tensor)`` as the tensor did: a read behind that test (``if isinstance(self.prev,
    torch.Tensor): h = h + self.prev.mean()``) was skipped by the replay, gradients off silently (11 of 36,
    ``repro_isinstance_gate.py``), where it must be refused."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return torch.Tensor

    def __init__(self, name: str, owner: str = _OF_OBJECT) -> None:
        self._remat_name = name
        self._remat_owner = owner

    def _refuse(self) -> RematError:
        name = object.__getattribute__(self, "_remat_name")
        owner = object.__getattribute__(self, "_remat_owner")
        return RematError(
            f"apply: a recomputation read the tensor attribute {name!r} of {owner}, which was rebound between the "
            "block's call and the backward; remat keeps such a tensor for the recomputation only where the first "
            "call that found it read it (not a cache the block only writes), and this one is gone; read it on every "
            "call, pass it to the block as an argument, or keep this block (a plan that does not recompute it)"
        )

    def __getattr__(self, name: str) -> Any:
        raise object.__getattribute__(self, "_refuse")()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        gone = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, _Gone))
        raise gone._refuse()


def _refusing(self: _Gone, *args: Any) -> Any:
    raise object.__getattribute__(self, "_refuse")()


# Python looks these up on the type, not through __getattr__: a tensor's truth value, length, items and
# arithmetic with a Python number (``if self.flag:``, ``self.prev * 0.5``) are refused too, not answered by
# object's defaults (truth: always True) or a TypeError.
for _op in (
    *("__bool__", "__len__", "__iter__", "__getitem__", "__setitem__", "__float__", "__int__", "__index__"),
    *("__neg__", "__pos__", "__abs__", "__invert__", "__lt__", "__le__", "__gt__", "__ge__"),
    *(
        f"__{p}{op}__"
        for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")
        for p in ("", "r", "i")
    ),
):
    setattr(_Gone, _op, _refusing)


def _module_copy(
    d: dict[str, Any], role: _Role | None, pending: dict[tuple[int, str], torch.Tensor] | None
) -> dict[str, Any]:
    """A module's ``__dict__`` as a call keeps it: its plain tensors that a call of ``role`` found unread (a
    cache the block only writes) weakly; those not decided yet noted in ``pending`` (NOTE [ Tensor attributes a
    block only writes ])."""
    copy = d.copy()
    if role is None or pending is None:
        return copy
    key, reads = id(d), role.tensor_reads
    for name, value in d.items():
        if type(value) is torch.Tensor:
            read = reads.get((key, name))
            if read is None:
                pending[(key, name)] = value
            elif not read:
                copy[name] = _Weak(value)
    return copy


def _learn_tensor_reads(role: _Role, pending: dict[tuple[int, str], torch.Tensor], read: set[int]) -> None:
    """After a call that found tensor attributes not decided on: whether it read each (ids in ``read``)."""
    for key, t in pending.items():
        role.tensor_reads.setdefault(key, id(t) in read)


class _ReadWatch(TorchDispatchMode):
    """Notes which of ``targets`` (by id) an op of the call takes (NOTE [ Tensor attributes a block only writes ])."""

    def __init__(self, targets: dict[tuple[int, str], torch.Tensor]) -> None:
        super().__init__()
        self.targets = {id(t) for t in targets.values()}
        self.read: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for a in tree_leaves((args, kwargs)):
            if id(a) in self.targets:
                self.read.add(id(a))
        return func(*args, **kwargs)


def _object_copy(
    d: dict[str, Any],
    role: _Role | None,
    pending: dict[tuple[int, str], torch.Tensor] | None,
    key: int | None = None,
) -> dict[str, Any]:
    """A plain object's ``__dict__`` as a call keeps it: the tensors ``role``'s learning call did not read there
    (a cache the block writes) weakly, so as not to hold them to the backward; those it read (a gain, an
    average) strongly; those set since its learning call as the first call that found them decides (NOTE
    [ Tensor attributes a block only writes ]: ``pending`` until then, and kept strongly)."""
    copy = d.copy()
    reads = role.object_reads if role is not None else None
    if reads is None:
        return copy
    # ``key``: the object's id where ``d`` is a copy of its slots (NOTE [ Containers and slots of plain objects ]).
    key, names = id(d) if key is None else key, role.object_names  # type: ignore[union-attr]
    for name, value in d.items():
        if isinstance(value, torch.Tensor):
            if (key, name) in names:
                if (key, name) not in reads:
                    copy[name] = _Weak(value)
                continue
            read = role.tensor_reads.get((key, name))  # type: ignore[union-attr]
            if read is None:
                if pending is not None:
                    pending[(key, name)] = value
            elif not read:
                copy[name] = _Weak(value)
    return copy


def _learn_object_reads(role: _Role, dicts: _Dicts, modules: int) -> None:
    """After a learning call: the tensors of plain objects it read, by (object, name) (``_object_copy``)."""
    ids = {id(t) for t in (ref() for ref in role.reads) if t is not None}
    objects = [(d, then) for d, then in dicts[modules:] if type(then) is not list]
    # NOTE [ Containers and slots of plain objects ]: slots the call rebound itself (a counter) are left out,
    # of this call's record too.
    written = set(role.slots_written)
    for d, then in objects:
        if not isinstance(d, dict):
            # A counter (``self.tally.n += 1``); a tensor the call rebinds (a running value it reads) is set back.
            mine = [
                n
                for n, v in then.items()
                if (now := getattr(d, n, _MISSING)) is not v
                and not isinstance(v, torch.Tensor)
                and not isinstance(now, torch.Tensor)
            ]
            written.update((id(d), n) for n in mine)
            for n in mine:
                del then[n]
    role.slots_written = frozenset(written)
    role.object_names = frozenset((id(d), name) for d, then in objects for name in then)
    role.object_reads = frozenset(
        (id(d), name) for d, then in objects for name, value in then.items() if id(value) in ids
    )


class _DictsAs:
    """Sets the attributes recorded by ``_dicts_at`` as they were at the call for a replay, and the current
    ones back after (NOTE [ Attributes other code sets ], NOTE [ Context managers of a replay ])."""

    __slots__ = ("recorded", "modules", "now")

    def __init__(self, recorded: _Dicts, modules: int) -> None:
        # ``modules``: how many of ``recorded`` are modules' (``_BindingsKept`` puts back what a replay binds there).
        self.recorded, self.modules = recorded, modules
        self.now: list[tuple[Any, Any]] = []

    def __enter__(self) -> None:
        for k, (d, then) in enumerate(self.recorded):
            if type(d) is not dict and k >= self.modules:
                self._enter_other(d, then)
                continue
            if _same_items(d, then):
                if k >= self.modules:  # an object's: what the replay binds there is put back too
                    self.now.append((d, then))
                continue
            self.now.append((d, d.copy()))
            for name in [n for n in d if n not in then and n not in _OWN_ENTRIES]:
                del d[name]
            for name, value in then.items():
                if type(value) is _Weak:
                    value = value.get(name, _OF_OBJECT if k >= self.modules else _OF_MODULE)
                if name not in _OWN_ENTRIES and d.get(name, _MISSING) is not value:
                    d[name] = value

    def _enter_other(self, d: Any, then: Any) -> None:
        # A list an object holds, or a slotted object (NOTE [ Containers and slots of plain objects ]).
        if type(d) is list:
            self.now.append((d, d.copy()))
            if len(d) != len(then) or not all(map(operator.is_, d, then)):
                d[:] = then
        elif isinstance(d, dict):  # an OrderedDict
            self.now.append((d, d.copy()))
            if not _same_items(d, then):
                d.clear()
                d.update((n, v.get(n, _OF_OBJECT) if type(v) is _Weak else v) for n, v in then.items())
        else:
            self.now.append((d, {n: getattr(d, n, _MISSING) for n in then}))
            _set_slots(d, then)

    def __exit__(self, *exc: object) -> None:
        for d, was in self.now:
            if type(d) is dict:
                _restore_entries(d, was)
            elif type(d) is list:
                if len(d) != len(was) or not all(map(operator.is_, d, was)):
                    d[:] = was
            elif isinstance(d, dict):
                if not _same_items(d, was):
                    d.clear()
                    d.update(was)
            else:
                _set_slots(d, was)


def _set_slots(obj: Any, values: dict[str, Any]) -> None:
    """Bind ``obj``'s slots to ``values`` (an absent one deleted) where they differ."""
    for name, value in values.items():
        if type(value) is _Weak:
            value = value.get(name, _OF_OBJECT)
        if getattr(obj, name, _MISSING) is value:
            continue
        if value is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, value)


# NOTE [ Values a forward reads through its code ]
# NOTE [ Attributes other code sets ] covers what a block reaches through ``self``. A forward also reads
# values through its code: a module-level global (``h * SCALE``, ``h * GAIN``, ``GLIST[0]``), an attribute
# of a user's Python module (``h * config.SCALE``), a closure cell (a helper closing over a value that
# ``nonlocal`` rebinds), the list a ``functools.partial`` the block holds was given. Rebound or edited
# between the call and the backward (a training loop setting ``SCALE``, the model between blocks), the
# replay read the later value: 82-98 of 99 outputs, gradients and parameters off over 3 SGD steps
# (helper-126, ``repro_patterns.py``; a float global only where a later member of a segment takes the
# output: a Python scalar's multiply saves no tensor that depends on it). So the first call of a member
# finds, once (0.2-0.4 ms a role), where its code reads such values (``_code_slots``): the functions of its
# modules' classes (not torch's own) and instance functions, the member's ``forward`` from before ``apply``,
# and, from those, the Python functions and ``partial``s they reach through globals and closure cells, four
# levels down (not torch's, numpy's, the standard library's or remat's); a name of a code object (nested
# ones included) that the function's globals or an imported user module binds to a primitive, a plain
# tensor or a small list, tuple or dict of them (``_kept_value``) is a slot, as is each closure cell holding
# such a value and each list or dict a ``partial`` holds. Each call keeps the slots' values (C code), and
# copies of the lists and dicts among them; a replay where one was rebound or edited gets the call's for
# itself and the current ones back after (``_CodeAs``; what the replay rebinds is put back too: a global
# counter counts the forward's calls, as in the plain model). Names and cells the code only stores (``dis``:
# no load in any of its code objects; a cache ``global LAST; LAST = h``) are not kept per call, which would
# hold the previous block's tensor to the backward, charged nowhere: only put back after a replay (the
# replay's tensor, with its graph, does not stay bound). A list or dict the learning call edits itself
# (a call log passed in a ``partial``) is left alone: it sees the replays, as a slotted object's counter does
# (NOTE [ Containers and slots of plain objects ]). Cost: none for a block whose code reads no such value
# (nn.Linear, GELU, workload A's layer: ``_code_values`` returns ``()``, the replay enters ``_NOTHING``); a
# tuple of lookups per call otherwise (an HF layer: about 20 cells of its decorators, their arguments). Not
# seen: a value read through an object the code fetches at run time (``getattr(sys.modules[...], name)``, a
# class attribute), a list of more than 64 items, code that is not Python (a C extension's state), and
# functions reached only through an attribute of an object (``self.helper.fn``) rather than a global.
_CODE_DEPTH = 4
_CODE_FUNCTIONS = 256
_LIBRARY_ROOTS = frozenset({"torch", "numpy", "remat", "functorch", "triton", *sys.stdlib_module_names})
_CELL = operator.attrgetter("cell_contents")
_FUNCTIONS = (types.FunctionType, types.MethodType, functools.partial)


def _library(name: Any) -> bool:
    return not isinstance(name, str) or name.partition(".")[0] in _LIBRARY_ROOTS


@dataclass(frozen=True, eq=False)
class _CodeSlots:
    """Where a member's code reads values outside its modules (NOTE [ Values a forward reads through its code ])."""

    cells: tuple[Any, ...] = ()  # closure cells
    spaces: tuple[dict[str, Any], ...] = ()  # a globals dict or a user module's __dict__ ...
    names: tuple[str, ...] = ()  # ... and the name read there
    boxes: tuple[Any, ...] = ()  # the lists and dicts a ``partial`` was given
    # Cells and names the code only writes (a cache ``global LAST; LAST = h``): not kept per call (a tensor
    # there would be held to the backward), only put back after a replay.
    written: tuple[tuple[Any, ...], ...] = ()

    def values(self) -> tuple[Any, ...]:
        """The cells' contents then the names' bindings, now (C code; an empty cell or absent name: ``_MISSING``)."""
        try:
            cells = tuple(map(_CELL, self.cells))
        except ValueError:  # an empty cell
            cells = tuple(_cell_value(c) for c in self.cells)
        return cells + tuple(space.get(name, _MISSING) for space, name in zip(self.spaces, self.names))

    def bind(self, k: int, value: Any) -> None:
        """Bind value ``k`` of ``values()``."""
        n = len(self.cells)
        if k < n:
            if value is _MISSING:
                del self.cells[k].cell_contents
            else:
                self.cells[k].cell_contents = value
        elif value is _MISSING:
            self.spaces[k - n].pop(self.names[k - n], None)
        else:
            self.spaces[k - n][self.names[k - n]] = value


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _MISSING


def _code_slots(modules: list[nn.Module]) -> _CodeSlots:
    """Where the code of ``modules`` reads globals, closure cells and a ``partial``'s containers (NOTE [ Values a
    forward reads through its code ])."""
    work: list[tuple[Any, int]] = []
    for sub in modules:
        role = sub.__dict__.get("_remat_role")
        if role is not None and role.previous_forward is not None:
            work.append((role.previous_forward, 0))
        work += [(v, 0) for v in sub.__dict__.values() if isinstance(v, _FUNCTIONS)]
        for cls in type(sub).__mro__:
            if cls is nn.Module or _library(cls.__module__):
                continue
            for v in vars(cls).values():
                if isinstance(v, (staticmethod, classmethod)):
                    v = v.__func__
                elif isinstance(v, property):
                    v = v.fget
                if isinstance(v, types.FunctionType):
                    work.append((v, 0))
    cells: dict[int, Any] = {}
    names: dict[tuple[int, str], tuple[dict[str, Any], str]] = {}
    written: dict[tuple[int, str], tuple[Any, ...]] = {}
    boxes: dict[int, Any] = {}
    done: set[int] = set()
    while work and len(done) < _CODE_FUNCTIONS:
        fn, depth = work.pop()
        if id(fn) in done or depth > _CODE_DEPTH:
            continue
        done.add(id(fn))
        if isinstance(fn, types.MethodType):
            work.append((fn.__func__, depth))
        elif isinstance(fn, functools.partial):
            work.append((fn.func, depth + 1))
            for v in (*fn.args, *fn.keywords.values()):
                if type(v) in (list, dict) and len(v) <= _BOX_ITEMS:
                    boxes[id(v)] = v
                elif isinstance(v, _FUNCTIONS):
                    work.append((v, depth + 1))
        elif isinstance(fn, types.FunctionType) and not _library(fn.__globals__.get("__name__")):
            loads, stores = _loads_and_stores(fn.__code__)
            _code_reads(fn.__code__, fn.__globals__, depth, names, work, loads, stores, written)
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                v = _cell_value(cell)
                if isinstance(v, _FUNCTIONS):
                    work.append((v, depth + 1))
                elif v is not _MISSING and not _kept_value("", v):
                    continue
                elif name in loads:
                    cells[id(cell)] = cell
                elif name in stores:
                    written[(id(cell), "")] = (cell,)
    for key in (*names, *((id(c), "") for c in cells.values())):
        written.pop(key, None)
    spaces = tuple(space for space, _ in names.values())
    return _CodeSlots(
        tuple(cells.values()),
        spaces,
        tuple(name for _, name in names.values()),
        tuple(boxes.values()),
        tuple(written.values()),
    )


def _loads_and_stores(code: types.CodeType) -> tuple[set[str], set[str]]:
    """The names a code object (and those in it) loads, and those it only stores or deletes (``dis``; once per role)."""
    loads: set[str] = set()
    stores: set[str] = set()
    todo = [code]
    while todo:
        c = todo.pop()
        for ins in dis.get_instructions(c):
            if isinstance(ins.argval, str):
                if ins.opname.startswith("LOAD"):
                    loads.add(ins.argval)
                elif ins.opname.startswith(("STORE", "DELETE")):
                    stores.add(ins.argval)
        todo += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return loads, stores


def _code_reads(
    code: types.CodeType,
    g: dict[str, Any],
    depth: int,
    found: dict[tuple[int, str], tuple[dict[str, Any], str]],
    work: list[tuple[Any, int]],
    loads: set[str],
    stores: set[str],
    written: dict[tuple[int, str], tuple[Any, ...]],
) -> None:
    """The names a code object (and the code objects in it) reads through globals (``_code_slots``), and those it
    only writes."""
    names = code.co_names
    spaces = [g]
    for name in names:
        v = g.get(name, _MISSING)
        if isinstance(v, types.ModuleType) and not _library(v.__name__):
            spaces.append(vars(v))  # ``config.SCALE``: an attribute of a user's module
    for space in spaces:
        for name in names:
            v = space.get(name, _MISSING)
            if v is _MISSING or name.startswith("__"):
                continue
            if isinstance(v, (types.FunctionType, functools.partial)):
                work.append((v, depth + 1))
            elif isinstance(v, (nn.Module, types.ModuleType, type)) or not _kept_value(name, v):
                continue
            elif name in loads:
                found[(id(space), name)] = (space, name)
            elif name in stores:
                written[(id(space), name)] = (space, name)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_reads(const, g, depth, found, work, loads, stores, written)


# What a call keeps of its code slots: their values, and copies of the lists and dicts among them and of the
# partials' ones, as (the list or dict, its copy).
_CodeValues = tuple[tuple[Any, ...], tuple[tuple[Any, Any], ...]]


def _code_values(role: _Role, tree: _Tree) -> _CodeValues | tuple[()]:
    """The values of the member's code slots at the call (NOTE [ Values a forward reads through its code ])."""
    slots = role.code_slots
    if slots is None:
        slots = role.code_slots = _code_slots(tree.modules())
    if not slots.cells and not slots.names and not slots.boxes:
        return _WRITES_ONLY if slots.written else ()
    values = slots.values()
    if not slots.boxes and _NO_BOXES.issuperset(map(type, values)):  # no list or dict among them (C code)
        return values, ()
    copies = tuple((v, v.copy()) for v in (*values, *slots.boxes) if type(v) is list or type(v) is dict)
    return values, copies


_WRITES_ONLY: _CodeValues = ((), ())  # a member whose code only writes globals or cells: put back after a replay


def _learn_code_writes(role: _Role, recorded: _CodeValues | tuple[()]) -> None:
    """After a learning call: the lists and dicts reached through its code that the call itself edited (a call
    log passed in a ``partial``) are left alone by replays (NOTE [ Values a forward reads through its code ])."""
    if recorded:
        role.code_written = frozenset(id(box) for box, then in recorded[1] if not _same_box(box, then))


def _same_box(now: Any, then: Any) -> bool:
    if type(now) is list:
        return len(now) == len(then) and all(map(operator.is_, now, then))
    return _same_items(now, then)


def _set_box(box: Any, items: Any) -> None:
    if type(box) is list:
        box[:] = items
    else:
        box.clear()
        box.update(items)


class _CodeAs:
    """Binds the values a member's code reads (globals, closure cells, lists and dicts there and in a partial) as
    they were at the call for a replay, and the current ones back after (NOTE [ Values a forward reads through its
    code ], NOTE [ Context managers of a replay ])."""

    __slots__ = ("role", "recorded", "now", "boxes", "written")

    def __init__(self, role: _Role, recorded: _CodeValues) -> None:
        self.role, self.recorded = role, recorded
        self.now: tuple[Any, ...] = ()
        self.boxes: list[tuple[Any, Any]] = []
        self.written: list[tuple[tuple[Any, ...], Any]] = []

    def __enter__(self) -> None:
        slots = self.role.code_slots
        assert slots is not None
        self.written = [(slot, _written_value(slot)) for slot in slots.written]
        then, copies = self.recorded
        self.now = now = slots.values()
        if not all(map(operator.is_, now, then)):
            for k, (a, b) in enumerate(zip(now, then)):
                if a is not b:
                    slots.bind(k, b)
        written = self.role.code_written
        for box, items in copies:
            if id(box) not in written:
                self.boxes.append((box, box.copy()))
                if not _same_box(box, items):
                    _set_box(box, items)

    def __exit__(self, *exc: object) -> None:
        for box, items in self.boxes:
            if not _same_box(box, items):
                _set_box(box, items)
        slots = self.role.code_slots
        assert slots is not None
        now = slots.values()
        if not all(map(operator.is_, now, self.now)):
            for k, (a, b) in enumerate(zip(now, self.now)):
                if a is not b:
                    slots.bind(k, b)
        for slot, was in self.written:
            if _written_value(slot) is not was:
                _bind_written(slot, was)


def _written_value(slot: tuple[Any, ...]) -> Any:
    return _cell_value(slot[0]) if len(slot) == 1 else slot[0].get(slot[1], _MISSING)


def _bind_written(slot: tuple[Any, ...], value: Any) -> None:
    if len(slot) == 1:
        if value is _MISSING:
            del slot[0].cell_contents
        else:
            slot[0].cell_contents = value
    elif value is _MISSING:
        slot[0].pop(slot[1], None)
    else:
        slot[0][slot[1]] = value


class _Nothing:
    """A context manager that does nothing (a replay with no code slots: one shared instance)."""

    __slots__ = ()

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


_NOTHING = _Nothing()


def _restore_entries(d: dict[str, Any], was: dict[str, Any]) -> None:
    """Make ``d`` hold exactly the entries of ``was`` (the same objects), where it does not already."""
    if _same_items(d, was):
        return
    for name in [n for n in d if n not in was]:
        del d[name]
    for name, value in was.items():
        if d.get(name, _MISSING) is not value:
            d[name] = value


def _check_tree(name: str, named: list[tuple[str, nn.Module]], now: _Tree) -> None:
    """Refuses a replay of module ``name`` if a sub-module it had at the call was replaced or removed since
    (NOTE [ Attributes other code sets ])."""
    if named == now.named:  # C code: the names, and the modules by identity (nn.Module has no __eq__ of its own)
        return
    ids = {id(m) for _, m in now.named}
    gone = [(sub_name, m) for sub_name, m in named if id(m) not in ids]
    if gone:
        sub_name, m = gone[0]
        raise RematError(
            f"apply: the sub-module {sub_name!r} ({type(m).__name__}) of module {name!r} was replaced or removed "
            "after the module's call, before the backward, so its recomputation would run another module than "
            "the forward did; replace or remove sub-modules after the backward (or keep both and choose with a "
            "flag attribute), or keep this block (a plan that does not recompute it); where the module's own "
            "forward replaces it on its first call (a sub-module built lazily), call the model once before remat.apply"
        )


_MODULE_DICTS = frozenset(vars(nn.Module()))  # _parameters, _buffers, _modules, the hook dicts


def _replay_call(call: _Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    module, role = call.module, call.role
    if _is_fsdp(module) and hasattr(module, "unshard"):  # by class first: a failed hasattr costs a formatted error
        module.unshard()  # type: ignore[operator]  # FSDP2: its parameters were resharded after the forward
    swapped_buffers = _swap_buffers(call.buffer_slots)  # torch.func.functional_call's buffers, as at the call
    tree = _Tree(module)  # NOTE [ One walk per call ]
    _check_tree(role.name, call.named, tree)  # NOTE [ Attributes other code sets ]
    buffers = tree.named_buffers()
    # NOTE [ Buffers of a replay under create_graph ]
    state_slots = _state_in_slots(tree, buffers, call.state) if call.state and _LOCAL.create_graph else []
    copied = {name: value for name, value in call.state.items() if name in buffers} if not state_slots else {}
    current = {name: buffers[name].detach().clone() for name in copied}
    try:
        swapped = _swap_in_params(call)
    except BaseException:
        _put_back_state(state_slots)
        _put_back_buffers(swapped_buffers)
        raise
    try:
        if copied:
            with torch.no_grad():
                for name, value in copied.items():
                    buffers[name].copy_(value)
        with (
            _BindingsKept(tree),
            _DictsAs(call.dicts, len(call.named)),
            _CodeAs(role, call.code) if call.code else _NOTHING,
            _AutocastAs(call.autocast),
            _FlagsAs(call.flags),
            _AttrsAs(call.modes + call.attrs),
            _HooksAs(tree, call.hooks),
            _RequiresGradAs(call.grads),
            _ModesAs(role.name, call.dispatch_modes),
        ):
            return _invoke(module, role, call.inner, args, kwargs, replay=True, tree=tree)
    finally:
        _put_back_state(state_slots)
        if current:
            with torch.no_grad():
                for name, value in current.items():
                    buffers[name].copy_(value)
        _put_back(swapped)
        _put_back_buffers(swapped_buffers)


# NOTE [ Buffers of a replay under create_graph ]
# A replay runs with the buffers a call updates (BatchNorm's running statistics) as they were at the
# call: it copies those values into the buffers, replays, and copies the current ones back. What the
# replay saves goes through remat's hooks, which skip autograd's version check, so the two in-place
# copies are harmless in a plain backward. Under ``create_graph=True`` (MAML's inner step, a Hessian-
# vector product) the backward of the replayed ops records a graph of its own, and BatchNorm's double
# backward saves ``running_mean`` / ``running_var`` directly; a later replay's copies bumped their
# versions, and the outer backward then failed with torch's "modified by an inplace operation" where the
# plain model trains. In a backward that records a graph, the replay gets a copy of the call's values in
# each such buffer's slot instead, and the real buffers are neither read nor written: what that graph
# saves is a tensor nobody edits. Only where every such buffer is in one slot of the member's modules
# (a buffer two modules share, or one a class of its own names, would leave an alias reading the
# current values): otherwise the replay copies, as in a plain backward.
def _state_in_slots(
    tree: _Tree, buffers: dict[str, torch.Tensor], state: dict[str, torch.Tensor]
) -> list[tuple[dict[str, Any], str, Any]]:
    """Put a copy of ``state`` (buffer name -> value at the call) in the buffers' slots under ``tree``;
    returns (slot dict, name, tensor before) for each, to put back, or ``[]`` (nothing swapped) where a
    buffer is not in exactly one slot."""
    owners = dict(tree.named)
    slots: dict[int, int] = {}
    for _, sub in tree.named:
        for t in sub._buffers.values():
            if t is not None:
                slots[id(t)] = slots.get(id(t), 0) + 1
    places: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for name, value in state.items():
        if name not in buffers:
            continue
        prefix, _, leaf = name.rpartition(".")
        owner = owners.get(prefix)
        if owner is None or owner._buffers.get(leaf) is not buffers[name] or slots[id(buffers[name])] != 1:
            return []
        places.append((owner._buffers, leaf, value))
    out: list[tuple[dict[str, Any], str, Any]] = []
    for d, leaf, value in places:
        out.append((d, leaf, d[leaf]))
        d[leaf] = value.detach().clone()
    return out


def _put_back_state(slots: list[tuple[dict[str, Any], str, Any]]) -> None:
    for d, leaf, tensor in reversed(slots):
        d[leaf] = tensor


# NOTE [ Parameters under recomputation ]
# A replay must compute with the parameters the forward used. Each recorded call keeps the tensors in
# its modules' parameter slots, with their versions and addresses (references only: they are alive).
# A slot that holds another tensor at replay time (torch.func.functional_call put the module's own
# back after the forward: MAML's fast weights, stateless ensembles) gets the recorded tensor for the
# replay, so the gradients flow to the tensors the forward used. A recorded tensor edited in place
# since (an optimizer step, a clamp, ``p.data = ...`` before the backward) raises a RematError: the
# plain model's backward raises torch's "modified by an inplace operation" there. A forward that
# updates one of its parameters in place (an EMA codebook) would update it again in its replay: it
# raises on the call (an edit through ``p.data``, which moves no version counter, on the first call
# after ``apply``, by the parameter's float64 sum). Under FSDP2, which swaps and refills parameters between forward and backward
# itself, none of this is checked (``_Role.check_params``; also where ``fully_shard`` came after ``apply``).
def _param_refs(module: nn.Module, role: _Role) -> tuple[tuple[nn.Module, str, torch.Tensor, int, int], ...]:
    # Sharded when installed, or since (``fully_shard`` after ``remat.apply``: the module's class, or the
    # model's, is FSDP2's now).
    if not role.check_params or _fsdp_managed(module, role):
        return ()
    if role.param_slots is None:
        role.param_slots = tuple(
            (sub, name) for sub in module.modules() for name, p in sub._parameters.items() if p is not None
        )
    out = []
    for sub, name in role.param_slots:
        t = sub._parameters.get(name)
        if t is not None:
            out.append((sub, name, t, t._version, _address(t)))
    return tuple(out)


def _buffer_refs(tree: _Tree) -> tuple[tuple[nn.Module, tuple[tuple[str, torch.Tensor | None], ...]], ...]:
    """The buffer slots of ``tree.module`` and its sub-modules at a call, as (owner, its ``_buffers`` items)
    (references): a replay puts them back as they were (:func:`_swap_buffers`): tensors other code
    swapped in since (``torch.func.functional_call`` with buffers of its own), a slot that held None
    (a buffer the forward builds lazily, ``if self.buf is None: self.buf = ...``), a buffer registered
    since (``register_buffer`` in the forward), a buffer made a parameter since. Under FSDP2 too: it
    shards and swaps parameters between forward and backward, never buffers."""
    return tuple((sub, tuple(sub._buffers.items())) for _, sub in tree.named)


def _swap_buffers(
    slots: tuple[tuple[nn.Module, tuple[tuple[str, torch.Tensor | None], ...]], ...],
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Give each owner's ``_buffers`` its items at the call (hiding a parameter that took a buffer's name
    since); returns the dicts' items before, for :func:`_put_back_buffers`."""
    saved: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for owner, items in slots:
        bufs, params = owner._buffers, owner._parameters
        shadowed = [name for name, _ in items if name in params]
        if not shadowed and len(bufs) == len(items) and all(bufs.get(name, _MISSING) is t for name, t in items):
            continue
        saved.append((bufs, dict(bufs)))
        if shadowed:
            saved.append((params, dict(params)))
            for name in shadowed:
                del params[name]
        bufs.clear()
        bufs.update(items)
    return saved


def _put_back_buffers(saved: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    for d, items in reversed(saved):
        d.clear()
        d.update(items)


def _address(t: torch.Tensor) -> int:
    try:
        return int(t.data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return 0


def _value_sum(t: torch.Tensor) -> torch.Tensor | None:
    """A float64 sum of ``t``'s values (``None`` where it has none to compare: not floating, meta, a subclass)."""
    try:
        return t.detach().sum(dtype=torch.float64) if t.is_floating_point() and not t.is_meta else None
    except (RuntimeError, TypeError, NotImplementedError):
        return None


# NOTE [ Edits of a member's output through .data ]
# A segment's replay hands a member the recomputed output of the member before it where the forward
# handed it that output unchanged: the same tensor, at the same version and the same data (``h.data =
# other`` moves the data: no link). An in-place edit through ``h.data`` (``x.data.clamp_(-1, 1)`` between
# two layers, a write through a numpy view) changes the values and bumps no version counter, so the link
# held and the replay gave the next member the unedited values: every gradient below the segment differed
# (150 entries over 3 steps, silently; helper-119). A learning call sums each output (float64, no copy, as
# the parameters' check ``_param_sums``), and the call that takes it compares: a change is refused. Later
# calls are not checked (the model's code runs the same edits every step).
def _param_sums(params: tuple[tuple[nn.Module, str, torch.Tensor, int, int], ...]) -> list[torch.Tensor | None]:
    # The learning call's check for edits through ``p.data``, which bump no version counter: a float64
    # sum per parameter (no copy of it), compared after the call.
    out: list[torch.Tensor | None] = []
    for _, _, t, _, _ in params:
        try:
            # A meta tensor (accelerate's cpu_offload/disk_offload keep the weights elsewhere between calls and
            # put them in the slot inside the call) holds no values to compare.
            out.append(t.detach().sum(dtype=torch.float64) if t.is_floating_point() and not t.is_meta else None)
        except (RuntimeError, TypeError, NotImplementedError):  # a backend without float64, a subclass
            out.append(None)
    return out


def _check_params_kept(
    role: _Role,
    params: tuple[tuple[nn.Module, str, torch.Tensor, int, int], ...],
    sums: Sequence[torch.Tensor | None] = (),
) -> None:
    edited = [name for _, name, t, version, _ in params if t._version != version]
    for (_, name, t, _, _), before in zip(params, sums):
        if before is not None and not edited:
            after = t.detach().sum(dtype=torch.float64)
            if not (torch.equal(after, before) or bool(after.isnan() and before.isnan())):
                edited.append(name)
    if edited:
        raise RematError(
            f"apply: module {role.name!r} updates its parameter(s) {edited[:4]} in place in its forward (an EMA "
            "codebook?), so recomputing it would update them again; keep this block (a plan that does not "
            "recompute it), or hold that state in buffers (remat.apply(..., allow_stateful=True) restores those)"
        )


def _swap_in_params(call: _Call) -> list[tuple[nn.Module, str, torch.Tensor | None, bool]]:
    return _swap_params(call.role.name, call.params)


def _swap_params(
    block: str, params: tuple[tuple[nn.Module, str, torch.Tensor, int, int], ...]
) -> list[tuple[nn.Module, str, torch.Tensor | None, bool]]:
    """Put the tensors a call's forward found in its parameter slots back there for its recomputation
    (NOTE [ Parameters under recomputation ]); returns what to put back afterwards (:func:`_put_back`)."""
    swapped: list[tuple[nn.Module, str, torch.Tensor | None, bool]] = []
    for owner, name, t, version, address in params:
        if t._version != version or _address(t) != address:
            _put_back(swapped)
            raise RematError(
                f"apply: parameter {name!r} of module {block!r} was changed in place after the forward and "
                "before the backward (an optimizer step or a clamp before backward(), p.data = ...), so its "
                "recomputation would use other values; the plain model's backward would fail there too (torch: "
                "'modified by an inplace operation'); change parameters after the backward"
            )
        now = owner._parameters.get(name)
        if now is not t:
            swapped.append((owner, name, now, name in owner._parameters))
            owner._parameters[name] = t  # type: ignore[assignment]
    return swapped


def _put_back(swapped: Sequence[tuple[nn.Module, str, torch.Tensor | None, bool]]) -> None:
    for owner, name, value, present in reversed(swapped):
        if present:
            owner._parameters[name] = value  # type: ignore[assignment]
        else:  # the slot was deleted since the forward (a parameter made a buffer): leave no None behind
            owner._parameters.pop(name, None)


# ---------------------------------------------------------------------------------------------
# Calling a member
# ---------------------------------------------------------------------------------------------


def _is_batchnorm_buffer(module: nn.Module, name: str) -> bool:
    """Whether buffer ``name`` of ``module`` is one remat restores without asking (``restored_buffer``:
    a norm's running statistics, spectral norm's vectors)."""
    owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
    return restored_buffer(owner, name.rsplit(".", 1)[-1])


def _norm_buffers(module: nn.Module) -> frozenset[str]:
    # Running statistics of BatchNorm (and InstanceNorm with running stats): always snapshotted, since
    # the native kernels update running_mean/var in place without bumping their version counter.
    out = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, _NormBase) and sub.track_running_stats:
            out += [f"{prefix}.{n}" if prefix else n for n in ("running_mean", "running_var", "num_batches_tracked")]
    return frozenset(out)


def role_norms(module: nn.Module, role: _Role) -> frozenset[str]:
    """``_norm_buffers`` of a member, computed once per role (walking the module tree each call costs)."""
    if role.norms is None:
        role.norms = _norm_buffers(module)
    return role.norms


# What to do about a block calling torch.cond (errors.higher_order_refused): its first call is watched.
_HOP_FIX = "keep this block (a plan that does not recompute it), or checkpoint it with torch.utils.checkpoint"


# NOTE [ In-place edits of a member's output ]
# A member that edits a tensor argument in place (``nn.ReLU(inplace=True)``) would, replayed on the
# argument the forward gave it, edit it a second time: refused. But where that argument is an earlier
# member's output in every span the member runs in (``_LINK``: a ReLU after a Linear in a Sequential,
# with both in one segment), the replay hands it the output that member's replay just made, so it edits
# a new tensor once, as the forward did (torch's checkpoint_sequential relies on the same: segments of
# VGG-style Sequentials recompute exactly). Only a span starting at the member (its argument external)
# is refused. The earlier member must have made that tensor in its call: one it returns from its state
# (a cached tensor, a slice of a buffer) is the same old tensor in the replay, which the editing member
# would edit a second time (gradients and state silently off, helper-44). A tensor counts as made in a
# call when it (or the base it views) got its autograd node after the call started (``made_since``,
# by the nodes' sequence numbers). A tensor with no node (a frozen layer's output on an input that needs
# no grad, a forward run under ``torch.no_grad``: fine-tuning's frozen stems and encoders) counts as made
# when its storage is none of the call's tensor arguments, its modules' parameters and buffers and the
# tensors in their plain attributes, read after the call (``held_storages``): before, every such output
# counted as not made, and ReLU(inplace=True) after a frozen layer was refused in every segment (a VGG
# with a frozen first Linear: ``segments(2)`` refused where ``checkpoint_sequential`` is exact). A tensor
# held where remat does not look (a closure, a global) would pass that rule: the replay checks every
# edited output it hands on (``_Frame.check_made``), and refuses one that is the very storage the
# forward's call returned, before the editing member runs again. And while no member of a recording has
# saved anything (a frozen first layer), the scope holds the recording (``_frame_for``): the graph,
# which holds it otherwise, held nothing of it, and the next member started a recording of its own.
# Not checked: a tensor a member saved for backward that a later member
# edits in place (a Sigmoid's output, then ReLU(inplace=True)); the plain backward fails on it
# ("modified by an inplace operation"), the replay saves through hooks, which skip autograd's version
# check, and its buffers are copied back around each call, so versions cannot tell. The profile records
# which blocks edit only the previous block's output
# (``BlockProfile.edits_own_link``) and the solvers put them in segments, never at a segment's start
# (``Chain.startable``); their recomputation is priced at their plain forward, as they are never
# timed checkpointed alone.


class _StateGuard:
    """NOTE [ State under recomputation ] for one call of a member."""

    def __init__(self, module: nn.Module, role: _Role, leaves: Sequence[Any], tree: _Tree) -> None:
        self.module, self.role = module, role
        self.buffers = tree.named_buffers()
        self.versions = {n: b._version for n, b in self.buffers.items()}
        self.args = [t for t in leaves if isinstance(t, torch.Tensor)]
        self.arg_versions = [t._version for t in self.args]
        if role.learned:
            keep = {n: self.buffers[n] for n in role.stateful if n in self.buffers}
        else:
            keep = self.buffers
        with torch.no_grad():
            self.before = {n: b.detach().clone() for n, b in keep.items()}
            self.arg_copies = [t.detach().clone() for t in self.args] if not role.learned else []
        self.attr_before = _attr_values(module, role)
        self.attrs: tuple[tuple[nn.Module, str, Any], ...] = ()  # set by check()
        # Ids of its arguments that every span it runs in links to an earlier member's output: it may edit
        # those in place (NOTE [ In-place edits of a member's output ]); set after the call is recorded.
        self.own_links: set[int] = set()

    def check(self, rng: _RngState) -> dict[str, torch.Tensor]:
        """Validate what the call changed; return the pre-call values of the buffers it updates."""
        norms = role_norms(self.module, self.role)
        if self.role.learned:
            changed = [n for n, b in self.buffers.items() if b._version != self.versions[n] or n in norms]
        else:  # the learning call compares values too (not every kernel bumps the version counter)
            changed = [
                n
                for n, b in self.buffers.items()
                if b._version != self.versions[n] or n in norms or not same_values(b, self.before[n])
            ]
        edited = [
            i for i, t in enumerate(self.args) if t._version != self.arg_versions[i] and id(t) not in self.own_links
        ]
        role = self.role
        if not role.learned:
            stateful = [n for n in changed if not _is_batchnorm_buffer(self.module, n)]
            if edited or (stateful and not role.allow_stateful):
                self._restore(rng)
                if edited:
                    raise RematError(
                        f"apply: module {role.name!r} edits its tensor argument #{edited[0]} in place, so recomputing it "
                        "would edit it again; keep this block (a plan that does not recompute it)"
                    )
                raise RematError(
                    f"apply: module {role.name!r} updates buffer(s) {stateful[:4]} in its forward (a stateful forward), "
                    "so recomputing it is not exact in general; keep it (plan from remat.profile, which keeps such "
                    "blocks) or pass allow_stateful=True to remat.apply to recompute it with the buffers' values "
                    "restored around each recomputation"
                )
            role.stateful = frozenset(changed)
            self.attrs = _attrs_changed(self.attr_before)
            role.attrs = tuple((sub, name) for sub, name, _ in self.attrs)
            role.learned, role.learned_training = True, self.module.training
            return {n: self.before[n] for n in changed}
        unexpected = [n for n in changed if n not in role.stateful]
        if edited or unexpected:
            what = (
                f"edits its tensor argument #{edited[0]} in place" if edited else f"updated buffer(s) {unexpected[:4]}"
            )
            raise RematError(
                f"apply: module {role.name!r} {what} in this forward although its first checkpointed call did not; "
                "its recomputation would not be exact; keep it (a plan that does not recompute it) or remat.apply "
                "again after the change"
            )
        self.attrs = self.attr_before
        return {n: self.before[n] for n in role.stateful if n in self.before}

    def _restore(self, rng: _RngState) -> None:
        with torch.no_grad():
            for n, value in self.before.items():
                self.buffers[n].copy_(value)
            for t, value in zip(self.args, self.arg_copies):
                t.copy_(value)
        for sub, name, value in _attrs_changed(self.attr_before):
            if value is _MISSING:  # set by the call (NOTE [ Attributes a forward sets ])
                sub.__dict__.pop(name, None)
            else:
                sub.__dict__[name] = value
        rng.set()


def _run(module: nn.Module, role: _Role | None, args: tuple[Any, ...], kwargs: dict[str, Any], replay: bool) -> Any:
    # A real run of the module's own forward; a replayed one (no hooks ran) is counted and reported here.
    observer = _LOCAL.observer if replay else None
    if replay:
        _count(module)
    if observer is not None:
        observer(module, True, False)
    raised = True
    try:
        if role is not None and role.policy is not None and torch.is_grad_enabled():
            out = _run_policy(module, role, args, kwargs)
        else:
            out = _original(module, role)(*args, **kwargs)
        raised = False
        return out
    finally:
        if observer is not None:
            observer(module, False, raised)


# torch's selective checkpoint consumes its cache in the first backward, and reads it by op order: its
# errors for a second backward, or for a recomputation that runs other ops, name no module and no fix.
_SAC_ERRORS = ("backward an extra time", "not found in storage")


def _guarded_recompute(
    module: nn.Module,
    role: _Role,
    attrs: tuple[tuple[nn.Module, str, Any], ...],
    saved: list[Saved],
    pending: dict[tuple[int, str], torch.Tensor],
) -> Callable[..., Any]:
    """The block's forward for :func:`run_selective`: in the recomputation, first checks that no sub-module
    changed train/eval mode and no parameter ``requires_grad`` since the forward (either changes which ops
    run, and torch's cache is read by op order), and turns torch's own selective-checkpoint errors into a
    :class:`RematError` that names the block and the fix."""
    forward = _original(module, role)
    flags = _flags()
    learning = not role.learned  # ``attrs`` holds every plain attribute: set back those changed since
    tree = _Tree(module)  # NOTE [ One walk per call ]
    modes = [(m, m.training) for m in tree.modules()]
    grads = [(p, p.requires_grad) for p in tree.parameters()]
    plain = tuple(a for a in _plain_attrs(module, role) if a[1] != "training")  # at the call
    dicts = tree.dicts(role)  # NOTE [ Attributes other code sets ]
    code = _code_values(role, tree)  # NOTE [ Values a forward reads through its code ]
    pending.update(tree.pending)  # NOTE [ Tensor attributes a block only writes ]: the caller watches the call
    hooks = _hooks_at(tree)
    params = _param_refs(module, role)  # NOTE [ Parameters under recomputation ]: the forward's tensors
    buffer_slots = _buffer_refs(tree)
    dispatch_modes = _user_dispatch_modes()  # NOTE [ Dispatch modes around the forward ]
    runs = 0

    seen: list[tuple[Any, Any]] = []  # (object, snapshot) per non-tensor argument leaf

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal runs
        runs += 1
        if runs == 1:
            # run_selective rebuilds the containers from the leaves, and torch's checkpoint checks the
            # tensors' versions; an attribute set on an object argument since the call is checked here.
            for leaf in leaves((args, kwargs)):
                snap = None if isinstance(leaf, torch.Tensor) else _snapshot(leaf)
                if snap is not None:
                    seen.append((leaf, snap))
            with saves_recorded(saved):
                return forward(*args, **kwargs)
        edited = _first_edited(saved, module, role)
        if edited is not None:
            raise _edited_error(role.name, edited)
        for leaf, then in seen:
            if not then.same(leaf):
                raise RematError(
                    f"apply: an argument of module {role.name!r} ({type(leaf).__name__}), which runs under an op-level "
                    f"policy (RecomputeOps), was changed by the call or after it, before the backward ({_CHANGED}), "
                    "so its recomputation would differ or change it again; pass a fresh object per call, or keep "
                    f"this block or recompute it whole{_cache_hint(leaf)}"
                )
        flipped = [type(m).__name__ for m, training in modes if m.training != training]
        flipped += [f"a parameter's requires_grad ({tuple(p.shape)})" for p, rg in grads if p.requires_grad != rg]
        if flipped:
            raise RematError(
                f"apply: module {role.name!r} runs under an op-level policy (RecomputeOps) and its recomputation "
                f"in the backward found {flipped[:3]} changed since its forward (train()/eval() or requires_grad "
                "set between forward and backward); change them after the backward, or keep this block or "
                "recompute it whole"
            )
        swapped = _swap_params(role.name, params)
        swapped_buffers = _swap_buffers(buffer_slots)
        now = _Tree(module)  # NOTE [ One walk per call ]: the recomputation's own walk
        _check_tree(role.name, tree.named, now)
        try:
            with (
                torch.inference_mode(False),
                _BindingsKept(now),
                _DictsAs(dicts, len(tree.named)),
                _CodeAs(role, code) if code else _NOTHING,
                _FlagsAs(flags),
                _AttrsAs(plain + (_attrs_changed(attrs) if learning else attrs)),
                _HooksAs(now, hooks),
                _ModesAs(role.name, dispatch_modes),
                replaying(),
            ):
                return forward(*args, **kwargs)
        except RuntimeError as e:
            if "has been mutated" in str(e):
                raise RematError(
                    f"apply: module {role.name!r} runs under an op-level policy (RecomputeOps) that caches an op "
                    "whose output a later op of the block, or the model's code after the block (on a tensor the "
                    "block returned), edits in place, which torch's selective checkpoint refuses "
                    f"({str(e).splitlines()[0]}); recompute that op instead (remat.plan caches neither such an op "
                    "nor a returned output that autograd does not save whole), or keep this block"
                ) from e
            if not any(marker in str(e) for marker in _SAC_ERRORS):
                _raise_if_vmapped(role.name, e)
                raise
            raise RematError(
                f"apply: module {role.name!r} runs under an op-level policy (RecomputeOps), which torch's selective "
                "checkpoint allows one backward only (its cache is consumed): a second backward through it "
                "(retain_graph=True, a gradient penalty with create_graph=True) or a recomputation that runs "
                f"other ops than the forward is not possible ({str(e).splitlines()[0]}); plan without op-level "
                "policies (profile with remat.profile(..., ops=False)) or keep this block"
            ) from e
        finally:
            _put_back(swapped)
            _put_back_buffers(swapped_buffers)

    return call


def _raise_if_vmapped(name: str, e: BaseException) -> None:
    """A replay that fails inside a backward run under vmap (``torch.autograd.grad(..., is_grads_batched=True)``):
    torch's error (random ops under vmap) comes from inside remat; say which block and what to do."""
    # is_grads_batched uses torch's legacy vmap, which functorch's interpreter stack does not show: the
    # error names it.
    if isinstance(e, RuntimeError) and (
        torch._C._functorch.peek_interpreter_stack() is not None or str(e).startswith("vmap:")
    ):
        raise RematError(
            f"apply: recomputing {name!r} failed inside a batched backward (torch.autograd.grad with "
            f"is_grads_batched=True runs the backward under vmap): {str(e).splitlines()[0]}; remat.remove(model) "
            "for such a backward, or loop over the grad outputs"
        ) from e


# NOTE [ Saved-tensor hooks around the forward ]
# A caller's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``: activation compression,
# offloading) see every tensor the plain forward saves. A recomputed block saves nothing in its forward
# (remat's own hooks, or torch's checkpoint's, are innermost there) and its replay's tensors never reach
# them, as under torch.utils.checkpoint: where the hooks give back other values than they were given
# (bf16 compression), the gradients differ from the plain model's, silently (helper-61: 3e-5 to 3e-4).
# remat cannot tell a lossless hook from a lossy one, so a recomputed block's forward under hooks other
# than torch's ``save_on_cpu`` (lossless), torch's checkpoint's and remat's own is a RematError, unless
# ``remat.apply(..., allow_saved_tensor_hooks=True)`` says the hooks give back what they are given
# (torchtune's activation offloading): then, as with torch's checkpoint, the recomputed blocks bypass them.
_LOSSLESS_HOOKS = ("torch.utils.checkpoint", "remat.")


def _outer_hooks_refused() -> bool:
    """Whether the innermost saved-tensor hooks now are a caller's other than the lossless ones."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(True) if top is not None else None
    if not hooks:
        return False
    pack = hooks[0]
    where = getattr(pack, "__module__", None) or ""
    return not (where.startswith(_LOSSLESS_HOOKS) or getattr(pack, "__qualname__", "").startswith("save_on_cpu."))


def _eager_backend() -> bool:
    """Whether the graph dynamo traces now runs under a backend that calls torch's checkpoint region eagerly
    (``backend="eager"``: no AOTAutograd): there torch runs the region with ``preserve_rng_state=False``
    (``tag_activation_checkpoint_impl``), so a dropout inside draws another mask in the recomputation than
    in the forward. Run once at trace time only (NOTE [ Under torch.compile ])."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        name = getattr(InstructionTranslator.current_tx().output.compiler_fn, "compiler_name", None)
    except Exception:  # noqa: BLE001 - torch internals moved: take the eager path, which is always exact
        return True
    # torch's "eager" and "eager_debug" ... by name; a backend of the caller's own (torch._dynamo.explain's
    # graph accumulator, an aot_autograd wrapper) is taken to compile the region as AOTAutograd does.
    return isinstance(name, str) and name.startswith("eager")


def _refused_under_compile(allow_hooks: bool) -> bool:
    """:func:`_outer_hooks_refused` while dynamo traces: a module that ``_compiled`` would trace as torch's
    checkpoint bypasses the hooks as the eager runtime does, so such a call takes the eager path, which
    refuses it. Run once at trace time only: dynamo guards on inlineable (GraphModule) hooks alone, so a
    graph traced without hooks and called later under a caller's Python hooks is not checked again."""
    return (not allow_hooks and _outer_hooks_refused()) or _eager_backend()


def _refuse_outer_hooks(role: _Role) -> None:
    disabled = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    if disabled is not None:  # torch.autograd.graph.disable_saved_tensors_hooks(message) around the forward
        raise RematError(
            f"apply: module {role.name!r} is recomputed, and its forward runs where saved-tensor hooks are disabled "
            f"(torch.autograd.graph.disable_saved_tensors_hooks: {disabled!r}); recomputation needs them (as "
            "torch.utils.checkpoint does): keep this block, or run the forward outside that context"
        )
    if role.allow_hooks or not _outer_hooks_refused():
        return
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    pack = top(True)[0]  # type: ignore[misc]
    where = getattr(pack, "__module__", None) or ""
    raise RematError(
        f"apply: module {role.name!r} is recomputed, and its forward runs under saved-tensor hooks of the caller's "
        f"({getattr(pack, '__qualname__', type(pack).__name__)} from {where or '?'}): a recomputed block saves "
        "nothing in its forward and its replay's tensors do not pass through those hooks (as under "
        "torch.utils.checkpoint), so where they change what they keep (compression) the gradients would differ "
        "from the plain model's; if the hooks give back exactly what they are given (offloading), pass "
        "allow_saved_tensor_hooks=True to remat.apply; else keep this block, or leave the hooks out of the forward"
    )


# NOTE [ Dispatch modes around the forward ]
# A caller's ``TorchDispatchMode`` or ``TorchFunctionMode`` (fake quantisation, an FP8 or low-precision
# emulation, a mode that rewrites ops) changes what a member computes and saves. A replay ran under the
# modes of the backward: without a mode entered around the forward only, the replay computed other values
# (full and segment plans: gradients 0.01-0.06 off, silently, helper-71; torch's checkpoint does the same).
# Each recorded call keeps the caller's modes active at it (``_Call.dispatch_modes``; remat's, torch's
# checkpoint's and the observers' excluded: torch's FLOP counter, debug mode and memory tools, which change
# no value). Function modes never reach autograd's backward (around the whole step they are gone there
# too), so a replay enters the call's function modes again, as torch's checkpoint enters the forward's
# device mode again. Dispatch modes do reach it: around the whole step the replay runs under them as the
# plain backward does; one active at the call and not at the replay (or the other way round) is a
# RematError naming them.
_OWN_MODES = (
    "remat.",
    "torch.utils.checkpoint",
    "torch.utils.flop_counter",
    "torch.utils._debug_mode",
    "torch.distributed._tools",
)


def _users(stack: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(m for m in stack if not (type(m).__module__ or "").startswith(_OWN_MODES))


def _user_dispatch_modes() -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The caller's function modes and dispatch modes active now, outermost first (NOTE [ Dispatch modes
    around the forward ])."""
    return (
        _users(torch.overrides._get_current_function_mode_stack()),
        _users(torch.utils._python_dispatch._get_current_dispatch_mode_stack()),
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class _ModesAs:
    """A replay under the modes of the call (NOTE [ Dispatch modes around the forward ], NOTE [ Context
    managers of a replay ])."""

    __slots__ = ("name", "recorded", "stack")

    def __init__(self, name: str, recorded: tuple[tuple[Any, ...], tuple[Any, ...]] | tuple[()]) -> None:
        self.name, self.recorded = name, recorded
        self.stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        functions, dispatch = self.recorded or ((), ())
        now_functions, now_dispatch = _user_dispatch_modes()
        if not _same(now_dispatch, dispatch) or (now_functions and not _same(now_functions, functions)):
            then = [type(m).__name__ for m in (*functions, *dispatch)] or "none"
            now = [type(m).__name__ for m in (*now_functions, *now_dispatch)] or "none"
            raise RematError(
                f"apply: module {self.name!r} ran its forward under the modes {then} and is recomputed in the "
                f"backward under {now} (a TorchDispatchMode entered around the forward only, or around the backward "
                "only), so its recomputation would compute other values than its forward (NOTE [ Dispatch modes "
                "around the forward ] in remat.core.runtime); enter the mode around both the forward and the "
                "backward, or keep this block (a plan that does not recompute it)"
            )
        if not now_functions and functions:
            stack = self.stack = contextlib.ExitStack()
            for mode in functions:
                stack.enter_context(mode)

    def __exit__(self, *exc: Any) -> bool | None:
        return self.stack.__exit__(*exc) if self.stack is not None else None


def _refuse_functorch(role: _Role) -> None:
    if torch._C._functorch.peek_interpreter_stack() is not None:
        raise RematError(
            f"apply: module {role.name!r} runs under a torch.func transform (grad, vjp, vmap, jacrev), which "
            "saved-tensor hooks and so checkpointing do not support; remat.remove(model) before the transform, "
            "or differentiate with torch.autograd"
        )


def _run_policy(module: nn.Module, role: _Role, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A block under an op-level policy (NOTE [ Op-level policies ] in ``remat.core.selective``)."""
    assert role.policy is not None
    _refuse_functorch(role)
    _refuse_outer_hooks(role)
    if role.learned and role.learned_training != module.training:
        role.learned = False  # NOTE [ State under recomputation ]: a mode change learns again
    buffers = [(name, b, b._version) for name, b in module.named_buffers()]
    arg_versions = [(i, t, t._version) for i, t in enumerate(leaves((args, kwargs))) if isinstance(t, torch.Tensor)]
    watch = (
        GeneratorWatch(_known(module, leaves((args, kwargs))), module.buffers())
        if not role.learned
        else contextlib.nullcontext()
    )
    py_before = _py_states() if not role.learned else None
    attrs = _attr_values(module, role)
    own = list(module.modules()) if not role.learned else []
    learning_dicts = _dicts_at(own, role) if not role.learned else ()  # NOTE [ Attributes other code sets ]
    saved: list[Saved] = []  # NOTE [ Saved tensors edited before the backward ] in remat.core.versions
    pending: dict[tuple[int, str], torch.Tensor] = {}  # NOTE [ Tensor attributes a block only writes ]
    code_at_call = _code_values(role, _Tree(module)) if not role.learned else ()
    forward = _guarded_recompute(module, role, attrs, saved, pending)
    read_watch = _ReadWatch(pending) if pending and role.learned else None
    with watch, read_watch or contextlib.nullcontext(), higher_order_refused(f"apply: module {role.name!r}", _HOP_FIX):
        out = run_selective(forward, args, kwargs, role.policy, f"module {role.name!r}")
    if read_watch is not None:
        _learn_tensor_reads(role, pending, read_watch.read)
    if not role.learned:
        role.attrs = tuple((sub, name) for sub, name, _ in _attrs_changed(attrs))
    if py_before is not None and _py_drew(py_before):
        raise RematError(
            f"apply: module {role.name!r} draws from Python's random or numpy's global generator, which torch's "
            "selective checkpoint does not restore, so an op-level policy (RecomputeOps) would draw other numbers "
            "in its recomputation; keep this block or recompute it whole (remat restores those generators there)"
        )
    if isinstance(watch, GeneratorWatch):
        if watch.found:
            for gen, st in watch.found.values():
                gen.set_state(st)
            raise RematError(
                f"apply: module {role.name!r} draws random numbers from a generator of its own, which torch's "
                "selective checkpoint does not restore, so an op-level policy (RecomputeOps) would draw different "
                "numbers in its recomputation; keep this block or recompute it whole (remat.plan does not offer "
                "policies for such blocks)"
            )
        if watch.fills_made:
            # NOTE [ Ops that fill a saved argument ]: torch's selective checkpoint stops its recomputation
            # inside such an op, before its kernel fills what the backward reads.
            raise RematError(
                f"apply: module {role.name!r} runs an op that fills a tensor it made through an argument it does not "
                "return and saves it (RReLU's noise: rrelu_with_noise), which torch's selective checkpoint recomputes "
                "only up to before that op's kernel, so an op-level policy (RecomputeOps) would compute its backward "
                "with unfilled memory; keep this block or recompute it whole (remat.plan does not offer policies "
                "for such blocks)"
            )
        role.learned, role.learned_training = True, module.training
        role.reads = watch.all_reads
        _learn_object_reads(role, learning_dicts, len(own))
        _learn_code_writes(role, code_at_call)  # NOTE [ Values a forward reads through its code ]
        _learn_tensor_reads(role, pending, {id(t) for t in (ref() for ref in role.reads) if t is not None})
        updated = [t for t in (ref() for ref in watch.updated.values()) if t is not None]
        if updated:
            role.learned = False  # refused on every call, not only the first
            raise _updated_error(role.name, updated[0])
    saved.extend(_note_reads(role))
    edited = [i for i, t, version in arg_versions if t._version != version]
    if edited:
        # Torch's selective checkpoint would run the edit again in the backward, on the argument itself (its
        # saved-tensor check then fails there with a RuntimeError that names no module, or the edit lands twice).
        raise RematError(
            f"apply: module {role.name!r} edits its tensor argument #{edited[0]} in place, so an op-level policy "
            "(RecomputeOps) would edit it again in its recomputation; keep this block (remat.plan does not offer "
            "policies for such blocks)"
        )
    changed = [name for name, b, version in buffers if b._version != version]
    if changed:
        # Its recomputation in the backward would update them a second time: refuse before that happens
        # (the forward that just ran updated them once, as the plain model would have).
        raise RematError(
            f"apply: module {role.name!r} updates buffer(s) {changed[:4]} in its forward, so an op-level policy "
            "(RecomputeOps) would update them again in the backward; keep this block or recompute it whole "
            "(remat.plan does not offer policies for such blocks)"
        )
    return out


def _frame_for(span: _Span, position: int) -> _Frame:
    scope = _LOCAL.scope
    if scope is None:
        scope = _LOCAL.scope = {}
    entry = scope.get(id(span))
    frame = entry[0]() if entry is not None else None
    if frame is None or entry is None or position <= entry[1]:
        frame = _Frame(span)  # a new forward, or the model called a member again: a new recording
    if position + 1 >= span.size:
        scope.pop(id(span), None)  # the last member: the recording is complete
    else:
        # The graph holds a recording through the holders of what it saved. Until a member saves something
        # (a frozen first layer on an input that needs no grad saves nothing), the scope holds it: else it
        # was freed before the next member, which then started a recording of its own with its argument
        # external, and an in-place edit of it (ReLU(inplace=True) after the frozen layer) was refused
        # (NOTE [ In-place edits of a member's output ]).
        # The scope holds it to the span's last member whatever it saved: a holder packed for a nested
        # span's saved inputs (its ``_SaveInputs`` node, on an input that needs no grad) dies with that
        # span's recording, which ends before this span's, and the recording was then freed before the
        # next member as above (``R[0:5](R[0:2](K0 K1) K2 K3 K4)`` with 0 and 1 frozen, ReLU(inplace=True)
        # as 2: refused).
        scope[id(span)] = (weakref.ref(frame), position, frame)
    return frame


def _invoke(
    module: nn.Module,
    role: _Role,
    spans: tuple[tuple[_Span, int], ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    replay: bool,
    tree: _Tree | None = None,
) -> Any:
    # ``tree``: the walk a replay made of ``module`` just before (NOTE [ One walk per call ]).
    if not spans or not torch.is_grad_enabled():
        check = role.size_check
        if check is not None and not replay and not check.sizes.warned and torch.is_grad_enabled():
            found: list[torch.Tensor] = []
            _tensors_in((args, kwargs), found, 4)
            check.check(module, found, args, kwargs)  # an op-level policy
        return _run(module, role, args, kwargs, replay)
    _refuse_functorch(role)
    _refuse_outer_hooks(role)
    if role.learned and role.learned_training != module.training:
        role.learned = False  # NOTE [ State under recomputation ]: a mode change learns again
    flat, spec = flatten((args, kwargs))  # once for the call: each recording takes it (Frame.record)
    if role.size_check is not None and not replay and not role.size_check.sizes.warned:
        role.size_check.check(module, flat, args, kwargs)
    lazy = [leaf for leaf in flat if isinstance(leaf, Iterator) and not isinstance(leaf, (torch.Tensor, io.IOBase))]
    if lazy:
        # The forward consumes it: a replay would get it drained (a raw StopIteration in the backward) or
        # draw other items (as remat.profile refuses a block returning one).
        raise RematError(
            f"apply: module {role.name!r} takes a {type(lazy[0]).__name__} (an iterator), which its forward "
            "consumes, so a recomputation cannot call it again as the forward did; pass a tuple or a list"
        )
    overlap = _Overlap()  # NOTE [ Draws of other threads ]: from before the call's RNG state is read
    try:
        earlier = _LOCAL.last_rng() if _LOCAL.last_rng is not None else None
        rng, rng_bytes = _rng_state(flat, role.generators)
        # NOTE [ One RNG state per segment ]: a state shared with an earlier call is held by that call's
        # recording; where the next call is a member of a span of this one, it keeps the reference (below).
        shared = earlier is not None and rng.cpu is earlier
        tree = tree if tree is not None else _Tree(module)  # NOTE [ One walk per call ]
        guard = _StateGuard(module, role, flat, tree)
        params = _param_refs(module, role)
        buffer_slots = _buffer_refs(tree)
        learning = not role.learned
        sums = _param_sums(params) if learning else []
        py_before = _py_states() if not role.learned or role.py_rng else None  # 50 us: learned on the first call
        watch = GeneratorWatch(_known(module, flat), module.buffers()) if not role.learned else None
        read_watch: _ReadWatch | None = None
        mark = sequence_mark()
        with contextlib.ExitStack() as stack:
            recorded: list[tuple[_Frame, int]] = []
            frames = [(_frame_for(span, position), k) for k, (span, position) in enumerate(spans)]
            calls: list[int] = []
            for frame, k in frames:
                # Recording the call saves its external tensors under the hooks of the spans around it.
                calls.append(frame.record(module, role, flat, spec, rng, rng_bytes, spans[k + 1 :], tree))
                stack.enter_context(frame.packing(calls[-1]))
                recorded.append((frame, calls[-1]))
            guard.own_links = set.intersection(
                *(
                    {
                        id(flat[j])
                        for j, slot in enumerate(frame.calls[c].slots)
                        if slot[0] == _LINK and frame.outs[id(flat[j])][4]
                    }
                    for frame, c in recorded
                )
            )
            if watch is not None:
                stack.enter_context(higher_order_refused(f"apply: module {role.name!r}", _HOP_FIX))
                stack.enter_context(watch)
            elif tree.pending:  # NOTE [ Tensor attributes a block only writes ]
                read_watch = stack.enter_context(_ReadWatch(tree.pending))
            out = _run(module, role, args, kwargs, replay)
    finally:
        overlap.exit()
    if watch is not None:
        # The learning call: the generators it drew from, at their states before its first draws.
        rng.generators.update(watch.found)
    state = guard.check(rng)
    if guard.own_links:
        for t, version in zip(guard.args, guard.arg_versions):
            if t._version != version and id(t) in guard.own_links:
                # An output edited here: the replay checks that its call makes it anew (one with no autograd
                # node counted as made by its storage: NOTE [ In-place edits of a member's output ]).
                for frame, _ in recorded:
                    frame.note_edited(t)
    _check_params_kept(role, params, sums)
    py_rng = py_before if py_before is not None and _py_drew(py_before) else None
    role.py_rng = role.py_rng or py_rng is not None
    if watch is not None:
        role.generators = tuple(gen for gen, _ in watch.found.values())
        role.reads = watch.all_reads
        _learn_object_reads(role, tree.dicts(role), len(tree.named))  # NOTE [ Attributes other code sets ]
        _learn_code_writes(role, recorded[0][0].calls[recorded[0][1]].code if recorded else ())
        _learn_tensor_reads(role, tree.pending, {id(t) for t in (ref() for ref in role.reads) if t is not None})
        role.fills_saved = role.fills_saved or watch.fills_made
        updated = [t for t in (ref() for ref in watch.updated.values()) if t is not None]
        if updated:
            role.learned = False  # refused on every call, not only the first
            raise _updated_error(role.name, updated[0])
    elif read_watch is not None:
        _learn_tensor_reads(role, tree.pending, read_watch.read)  # NOTE [ Tensor attributes a block only writes ]
    reads = _note_reads(role)
    # What the call could return without making it, for its outputs with no autograd node (made_since).
    outs = output_leaves(out)
    held = (
        held_storages([module], flat) if any(isinstance(t, torch.Tensor) and t.grad_fn is None for t in outs) else None
    )
    next_member = any(pos + 1 < span.size for span, pos in spans)
    end_rng = _state_bytes(torch.get_rng_state()) if next_member or overlap.seen else None
    drew_to = end_rng if overlap.seen and end_rng != rng_bytes else None  # NOTE [ Draws of other threads ]
    end_rng = end_rng if next_member else None
    # NOTE [ One RNG state per segment ]
    # The cost model charges one RNG state per checkpoint (Chain.ckpt_state_bytes, in segment_bytes) and a copy
    # per later call of a segment only after a draw (Chain.rng_copy_bytes): with no draw in between, a nested
    # checkpoint that starts inside a segment shares the segment's state. A non-first member's call that
    # shared it used to drop the reference here, so the next call made a fresh copy; a nested checkpoint at
    # the third position or later (fuzz seed 366, ``R[0:4](K0 K1 R[2:3](K2) K3)``) then held a second state
    # from the forward to its backward, charged nowhere: 1.168x the budget with two of them. The reference is
    # dropped only where the next call starts a new top-level segment, as the model charges.
    if (
        _LOCAL.last_rng is not None
        and _LOCAL.last_rng() is rng.cpu
        and all(frame.calls[index].rng.cpu is None for frame, index in recorded)
        and not (shared and any(pos + 1 < span.size for span, pos in spans))
    ):
        # No recording keeps this call's state: do not hold it past the call.
        _LOCAL.last_rng = _LOCAL.last_rng_bytes = None
    for (frame, index), (span, position) in zip(recorded, spans):
        frame.calls[index].state = state
        frame.calls[index].params = params
        frame.calls[index].buffer_slots = buffer_slots
        frame.calls[index].py_rng = py_rng
        frame.calls[index].attrs = guard.attrs
        frame.calls[index].reads = reads
        frame.record_output(index, outs, mark, held, learning and position + 1 < span.size)
        frame.calls[index].drew_to = drew_to
        frame.end_rng = end_rng if position + 1 < span.size else None  # the last member: no call follows
    return out


# NOTE [ Batches larger than the profiled one ]
# A plan's budget and predicted peak are those of the batch its profile ran: what each block saves, its
# transients and its output grow with the batch, so a step on longer sequences or larger images peaks
# above the budget (1.63-2.44x on the built-in GPT, a Llama and the ResNet at twice the tokens or 1.5x the
# pixels, helper-122) while its gradients stay exact: nothing fails, the budget silently does not hold. A
# plan made from a profile records each block's input bytes there (``Plan.input_bytes``, i.e.
# ``BlockProfile.input_bytes``: the storages of the tensors the block's first member is called with,
# parameters and buffers left out). ``apply`` gives the role of each block's first member a ``SizeCheck``
# (all sharing the plan's ``InputSizes``), and where block 0's first member has no role (kept, or kept with
# a sub-module recomputed: plans of only ``S`` operations are common at mild budgets) makes one its forward
# pre-hook: block 0 takes the batch in every step. So does every later kept block whose profiled input bytes
# no earlier block took: a decoder's first layer, which takes the encoder's output besides its own hidden
# states (a T5 from config planned on 16 target tokens and trained on 48 or 96 with the same sources grows
# only there: 1.44-2.93x its budget, unseen before, helper-127), and in split blocks the first of each kind
# (a Llama split: 2 hooks for 16 blocks); blocks of a size seen before belong to a stack whose first block is
# checked. Each call in a forward that records (grad on, not a replay: a replay runs no hooks either) sums
# its argument storages and warns once per applied plan (``RematWarning``) when they exceed the profiled bytes.
# - Cost: a recorded call sums over the leaves it flattens anyway (``flat``), 0.3 us for one tensor; the hook
#   and an op-level policy's call walk their arguments' tuples, lists and dicts (``_tensors_in``, a few us).
#   Only a sum above the profiled bytes leaves out the model's parameters and buffers (a rotary cache passed
#   to every layer is a buffer the profile did not count); a sum found within the profiled bytes that way is
#   remembered (``SizeCheck.fit_bytes``), so it is done once per size. After the warning, nothing is summed.
# - Smaller batches never warn (the plan then over-provisions: 0.33-0.81x its budget, helper-122), nor do
#   calls at most 3% above the profiled bytes (``_SLACK``: an extra scalar tensor argument).
# - State: plain objects in the installation (``Attached.sizes``), the roles and the hook dict, which
#   copy.deepcopy, pickle and torch.save carry (a copy made after the warning stays quiet); ``suspended``
#   (remat.profile of an applied model, on any batch, runs the model plain: quiet) installs them again with
#   the same ``InputSizes``; ``detach`` removes the hook.
# - Under torch.compile a region dynamo traces (``_compiled``, and the hook, whose ``is_compiling`` branch is
#   a constant there) is not checked: no new graph break; a block run eagerly under compile is checked.
#   ``remat.measure`` and ``check_gradients`` of an applied model on a larger batch run the plan on it and
#   warn: that step is the one above the budget.
# - Not checked: plans of strategies planned without a profile (nothing was measured; ``remat.apply(model,
#   remat.full())``), a kept block taking the same bytes as an earlier block when profiled that grows alone
#   (a second stack whose first layer takes exactly what the first stack's layers took), and tensors inside
#   objects other than tuples, lists and dicts (dataclasses: on recorded calls only).
@dataclass(eq=False)
class InputSizes:
    """The batch a plan from a profile was made for, per block, and whether its model warned already
    (NOTE [ Batches larger than the profiled one ]); one per applied plan, shared by its checks."""

    input_bytes: tuple[int, ...]  # per block, bytes (Plan.input_bytes)
    strategy: str
    budget_bytes: int | None
    predicted_peak_bytes: int | None
    model: nn.Module | None = None  # the applied model: its parameters and buffers are no inputs
    hooked: list[nn.Module] = field(default_factory=list)  # kept first members a SizeCheck watches as pre-hook
    warned: bool = False


# NOTE [ Batches larger than the profiled one ]: a call warns above the profiled bytes by more than 1/_SLACK
# (3%): the HF Trainer passes each layer a 4-byte ``num_items_in_batch`` tensor that a profile's call lacks
# (16644 bytes against 16640 on a small GPT-2, a warning on every Trainer run before the slack), and a step on
# a batch 3% larger stays within the 5% a measured peak may exceed its budget by.
_SLACK = 32


def _tensors_in(value: Any, out: list[torch.Tensor], depth: int) -> None:
    """The tensors in ``value`` and the tuples, lists and dicts in it, ``depth`` levels deep, into ``out``: a
    cheaper walk than ``flatten`` for a call that does not flatten its arguments anyway (a few microseconds
    for an HF layer's keyword arguments instead of tens)."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif depth and isinstance(value, (tuple, list)):
        for item in value:
            _tensors_in(item, out, depth - 1)
    elif depth and isinstance(value, dict):
        for item in value.values():
            _tensors_in(item, out, depth - 1)


@dataclass(eq=False)
class SizeCheck:
    """The check of one block's input bytes against the profiled batch's (NOTE [ Batches larger than the
    profiled one ]): called by its first member's role, or, where remat runs no call of it (a kept block),
    as that member's forward pre-hook. A plain object: copy.deepcopy, pickle and torch.save carry it."""

    sizes: InputSizes
    block: int
    name: str  # the member's FQN, for the message
    # The largest sum of a call's argument storages found within the profiled bytes once the model's
    # parameters and buffers were left out: a later call summing no more is not looked at again.
    fit_bytes: int = 0

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # As a forward pre-hook: traced away under torch.compile (constant there: no graph break).
        if torch.compiler.is_compiling() or self.sizes.warned or not torch.is_grad_enabled():
            return
        found: list[torch.Tensor] = []
        _tensors_in((args, kwargs), found, 4)
        self.check(module, found, args, kwargs)

    def check(self, module: nn.Module, flat: Sequence[Any], args: tuple[Any, ...], kwargs: Any) -> None:
        """Warn once per applied plan when this call takes more input bytes than the profile measured."""
        sizes = self.sizes
        profiled = sizes.input_bytes[self.block]
        limit = profiled + profiled // _SLACK
        total = 0
        for leaf in flat:
            if isinstance(leaf, torch.Tensor):
                try:
                    total += leaf.untyped_storage().nbytes()
                except (RuntimeError, NotImplementedError):
                    total += sum(storages(leaf, set()).values())  # sparse: its indices and values; a DTensor: none
        if total <= limit or total <= self.fit_bytes:
            return
        owner = sizes.model if sizes.model is not None else module
        held = set(storages([*owner.parameters(), *owner.buffers()], set()))
        found = sum(storages((args, kwargs), held, out=True).values())
        if found <= limit:
            self.fit_bytes = total
            return
        sizes.warned = True
        budget = (
            f"its budget {format_bytes(sizes.budget_bytes)}"
            if sizes.budget_bytes is not None
            else f"its predicted peak {format_bytes(sizes.predicted_peak_bytes or 0)}"
        )
        found_text, profiled_text = format_bytes_apart(found, profiled)  # NOTE [ Sizes a message compares ]
        warnings.warn(
            RematWarning(
                f"apply: module {self.name!r} (block {self.block} of the plan {sizes.strategy}) takes "
                f"{found_text} of tensor inputs, more than the {profiled_text} it took in the "
                f"batch the plan was profiled on, so this step can peak above {budget} (measured 1.6-2.4x at "
                "twice the tokens; gradients stay exact); re-profile and re-plan on the largest batch you train "
                "with: remat.plan(remat.profile(model, largest_inputs, loss_fn), budget) (warned once per applied plan)"
            ),
            stacklevel=_caller_level(),
        )


@dataclass(eq=False)
class Trainable:
    """Which parameters required grad when a plan's profile ran, checked once per forward of the applied model
    (NOTE [ Parameters unfrozen after planning ] in ``remat.blocks``); one per applied plan."""

    profiled: tuple[int, ...]  # per block, then the other modules (Plan.trainable_params)
    modules: list[list[nn.Module]]  # remat.blocks.param_modules of the applied model
    names: tuple[str, ...]  # each block's first member, for the message
    strategy: str
    budget_bytes: int | None
    predicted_peak_bytes: int | None
    warned: bool = False

    def check(self) -> None:
        """Warn once when more parameters of a block (or of the modules in no block) require grad than profiled."""
        counts = count_trainable(self.modules)
        over = [k for k, (now, then) in enumerate(zip(counts, self.profiled)) if now > then]
        if not over:
            return
        self.warned = True
        k = over[0]
        where = f"block {k} ({self.names[k]!r})" if k < len(self.names) else "the modules in no block"
        limit = (
            f"its budget {format_bytes(self.budget_bytes)}"
            if self.budget_bytes is not None
            else f"its predicted peak {format_bytes(self.predicted_peak_bytes or 0)}"
        )
        warnings.warn(
            RematWarning(
                f"apply: {where} has {counts[k]} parameters requiring grad, more than the {self.profiled[k]} when "
                f"the plan {self.strategy} was profiled{f' ({len(over)} groups grew)' if len(over) > 1 else ''}, so "
                f"its backward needs more saved tensors than the plan counted and this step can peak above {limit} "
                "(measured up to 1.30x after unfreezing half a model; gradients stay exact); profile and plan again "
                "after changing requires_grad (warned once per applied plan)"
            ),
            stacklevel=_caller_level(),
        )


# The folders of remat's and torch's code: a warning names the first frame outside them (the model's call).
_INTERNAL = (os.path.dirname(os.path.dirname(__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep)


def _caller_level() -> int:
    """The ``stacklevel``, for a ``warnings.warn`` in the function calling this one, of the first frame
    outside remat and torch: the user's line that called the model."""
    level, frame = 1, sys._getframe(1)  # the caller: level 1 of its warnings.warn
    at: types.FrameType | None = frame
    while at is not None and at.f_code.co_filename.startswith(_INTERNAL):
        level, at = level + 1, at.f_back
    return level


class _Threads:
    """Recorded calls and replays over all threads (NOTE [ Draws of other threads ]); read under ``lock``."""

    lock = threading.Lock()
    active: ClassVar[dict[int, int]] = {}  # thread id -> recorded calls and replays running in it
    alive: ClassVar[dict[int, threading.Thread]] = {}  # the threads that ran one, while they live
    entries = 0  # recorded calls and replays started, in every thread

    @staticmethod
    def several() -> bool:
        """Whether more than one live thread ran a recorded call or a replay."""
        alive = _Threads.alive
        if len(alive) > 1:
            for tid in [tid for tid, t in alive.items() if not t.is_alive()]:
                del alive[tid]
        return len(alive) > 1


class _Overlap:
    """Whether another thread's recorded call or replay ran while this one did, or another live thread ran
    one before (NOTE [ Draws of other threads ])."""

    __slots__ = ("own", "seen", "since", "tid")

    def __init__(self) -> None:
        self.tid = threading.get_ident()
        with _Threads.lock:
            _Threads.active[self.tid] = _Threads.active.get(self.tid, 0) + 1
            if self.tid not in _Threads.alive:
                _Threads.alive[self.tid] = threading.current_thread()
            _Threads.entries += 1
            self.seen = len(_Threads.active) > 1 or _Threads.several()
            self.since = _Threads.entries
        _LOCAL.entries += 1
        self.own = _LOCAL.entries

    def exit(self) -> None:
        with _Threads.lock:
            others = (_Threads.entries - self.since) - (_LOCAL.entries - self.own)
            self.seen = self.seen or others > 0 or len(_Threads.active) > 1 or _Threads.several()
            left = _Threads.active[self.tid] - 1
            if left:
                _Threads.active[self.tid] = left
            else:
                del _Threads.active[self.tid]


# NOTE [ Draws of other threads ]
# A replay draws its random numbers (dropout's masks) from the CPU generator put back to its state at the
# call, so it redraws what the forward drew only if nothing else drew from that generator while the
# forward ran. torch has one default CPU generator for all threads: two threads training two models with
# dropout interleave their draws, and a replay then drew other masks than its forward (two planned GPTs
# in two threads: 35 of 96 replayed dropout calls, gradients silently computed for masks the forward did
# not use; torch.utils.checkpoint does the same). A recorded call made while another live thread has run
# recorded calls or replays, or during which one ran (``_Overlap``: a lock and two counters, about a
# microsecond a call), and that drew, keeps the bytes of the state it ended at (Python memory, 5 KiB, as
# ``_Frame.end_rng``); a replay that ran the call to its end and stands elsewhere drew other numbers (the
# other thread drew during the forward, or during this replay), and raises. So a replay whose last saved tensor is one of such a call's
# does not stop there (torch's early stop) but at the call's end, as for NOTE [ Ops that fill a saved
# argument ]: the ops after it, which save nothing (a block's residual add after its last dropout), run
# once more; the chain model charges a replay's last block its whole forward anyway. (Reading the state
# at each saved tensor instead allocated 5 KiB of torch memory at every save: one test model measured
# one RNG state above its prediction; reading it at the end of every call did too, which is why only
# calls made with other threads about read it.) Draws of another thread while no recorded call of this
# one runs, or in a call that itself draws nothing, change nothing a replay computes. Not seen: a thread
# drawing outside remat's recorded calls and replays (a plain model's training, a no_grad forward in
# train mode, data augmentation in a thread), and another thread's first recorded call starting during
# the backward of a step whose forward ran alone.
def _other_draws_error(name: str) -> RematError:
    return RematError(
        f"apply: recomputing module {name!r} drew other random numbers from the CPU generator than its forward "
        "did: other code drew from torch's default generator while that forward ran (another thread training "
        "at the same time: all threads share it), so the recomputed dropout masks, and the gradients, would "
        "differ from the forward's; run one thread's training step (forward and backward) at a time (a lock "
        "around each step), give the random ops a torch.Generator of the block's own, or keep the blocks that "
        "draw random numbers"
    )


class _Dispatch:
    """The instance ``forward`` remat installs: a picklable callable, not a bound method."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _disable_for_compile()  # a model applied in another process: as _set_role does here

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            role: _Role = self.module.__dict__["_remat_role"]
            if _compilable(role) and not _REFUSED_UNDER_COMPILE[0](role.allow_hooks):
                return _compiled(self.module, role, args, kwargs)
        return _EAGER[0](self.module, args, kwargs)


_NOT_OBJECTS.add(_Dispatch)  # NOTE [ Attributes other code sets ]: remat's instance forward
_PLAIN_TYPES.add(_Dispatch)


# NOTE [ Under torch.compile ]
# remat's recording and replay are Python around autograd, which dynamo cannot trace. Where a plan's
# operation is exactly what torch's own checkpoint does, a single module recomputed alone (a
# one-module ``Recompute(k, k + 1)``, not nested in another span), dynamo traces
# ``torch.utils.checkpoint`` instead: one region, no graph break, compiled inside, and the compiler's
# partitioner recomputes what the region saved (RNG state preserved; BatchNorm's running statistics
# are functionalised and updated once). Segments of several modules, nested plans and op-level
# policies (``RecomputeOps``) run eagerly through ``_dispatch`` below (a graph break around each
# member). Op-level policies do not compile: dynamo takes a checkpoint's context_fn as a constant,
# which the policy's per-call op counters are not (traced, the block broke the graph inside and sent
# the whole model's forward back to eager), and torch warns that a selective checkpoint region under
# compile must not hold in-place ops (dropout's bernoulli_), which a plan's op keys do not all name.
def _compilable(role: _Role) -> bool:
    if role.policy is not None:
        return False
    return len(role.spans) == 1 and role.spans[0][0].size == 1


def _compiled(module: nn.Module, role: _Role, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    forward = _original(module, role)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    call = functools.partial(forward, **kwargs) if kwargs else forward
    return torch.utils.checkpoint.checkpoint(stop_passing(call), *args, use_reentrant=False, preserve_rng_state=True)


# Eagerly (and under torch.compile for what NOTE [ Under torch.compile ] does not cover: a graph break).
def _dispatch(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    role: _Role = module.__dict__["_remat_role"]
    return _invoke(module, role, role.spans, args, kwargs, replay=False)


# ``_dispatch`` behind torch.compiler.disable, which imports torch._dynamo (2.5 s): made when a plan is
# first attached (eagerly, before any compile traces ``_Dispatch``), not at ``import remat``.
_EAGER: list[Callable[..., Any]] = [_dispatch]


_REFUSED_UNDER_COMPILE: list[Callable[[bool], bool]] = [_refused_under_compile]


def _disable_for_compile() -> None:
    if _EAGER[0] is _dispatch:
        _EAGER[0] = torch.compiler.disable(_dispatch)
        _REFUSED_UNDER_COMPILE[0] = torch._dynamo.assume_constant_result(_refused_under_compile)


def _count(module: nn.Module) -> None:
    counts = _LOCAL.counts
    if counts is not None and id(module) in counts:
        counts[id(module)] += 1


# ---------------------------------------------------------------------------------------------
# Installing a plan
# ---------------------------------------------------------------------------------------------


def _set_role(module: nn.Module, role: _Role) -> None:
    if "_remat_role" in module.__dict__:
        raise RematError(
            f"apply: module {role.name!r} is already part of another checkpointed segment (a plan applied to it or "
            "to a module around it); remove that plan first"
        )
    module.__dict__["_remat_role"] = role
    _disable_for_compile()
    module.__dict__["forward"] = _Dispatch(module)


def _assign(
    model: nn.Module,
    ops: tuple[Op, ...],
    members: Sequence[list[nn.Module]],
    names: Sequence[tuple[str, ...]],
    roles: dict[int, tuple[nn.Module, str, list[tuple[_Span, int]]]],
    policies: dict[int, frozenset[str]],
) -> None:
    for op in ops:
        if isinstance(op, RecomputeOps):
            if len(members[op.index]) != 1:
                raise RematError(
                    f"apply: {op!r} puts an op-level policy on block {op.index} ({', '.join(names[op.index])}), a "
                    "group of modules; op-level policies apply to single-module blocks (op keys count per forward)"
                )
            in_place = sorted(k for k in op.save if k.rpartition("#")[0].endswith("_"))
            if in_place:
                # NOTE [ Selective recompute semantics ]: the caller may ignore an in-place op's return value
                # and read the recomputed tensor it was meant to mutate (torch refuses the mutated cache entry).
                raise RematError(
                    f"apply: {op!r} caches the in-place op(s) {in_place} of block {op.index} ({names[op.index][0]}); "
                    "an in-place op cannot be cached (its result lives in a tensor the recomputation makes "
                    "again); cache the op that made that tensor or recompute it (plans from remat.plan never do this)"
                )
            module = members[op.index][0]
            roles.setdefault(id(module), (module, names[op.index][0], []))
            policies[id(module)] = frozenset(op.save)
        elif isinstance(op, RecomputeSub):
            for fqn in op.fqns:
                sub = model.get_submodule(fqn)
                entry = roles.setdefault(id(sub), (sub, fqn, []))
                entry[2].append((_Span(fqn, 1), 0))
        elif isinstance(op, Recompute):
            flat = [(m, n) for k in range(op.start, op.stop) for m, n in zip(members[k], names[k])]
            span = _Span(flat[0][1], len(flat))
            for position, (module, name) in enumerate(flat):
                roles.setdefault(id(module), (module, name, []))[2].append((span, position))
            _assign(model, op.inner, members, names, roles, policies)
        elif not isinstance(op, Keep):
            raise RematError(
                f"apply: unknown plan operation {op!r}; expected Keep, Recompute, RecomputeSub or RecomputeOps"
            )


def install(
    model: nn.Module,
    ops: tuple[Op, ...],
    members: Sequence[list[nn.Module]],
    names: Sequence[tuple[str, ...]],
    *,
    allow_stateful: bool = False,
    allow_hooks: bool = False,
    reuse: dict[tuple[Op, ...], list[tuple[nn.Module, _Role]]] | None = None,
    sizes: InputSizes | None = None,
    hooks_from: int | None = None,
) -> list[nn.Module]:
    """Install the plan operations ``ops`` on ``model``'s modules (all or nothing).

    Args:
        model: The model (used for sub-module lookup).
        ops: Top-level plan operations over blocks ``0..n-1``.
        members: The member modules of each block.
        names: The member FQNs of each block (for messages).
        allow_stateful: Recompute modules whose forward updates buffers other than BatchNorm's
            (NOTE [ State under recomputation ]).
        allow_hooks: Recompute modules whose forward runs under saved-tensor hooks of the caller's
            (NOTE [ Saved-tensor hooks around the forward ]).
        reuse: Roles installed before for the same ``ops`` on the same model, by ``ops``: installed again
            as they are (what their first call learned included, so a later call does not learn again:
            the profile times one configuration in several iterations); filled for ``ops`` if absent.
        sizes: The profiled batch's input bytes per block, checked by the roles of the blocks' first
            members (NOTE [ Batches larger than the profiled one ]); ``None``: not checked.
        hooks_from: The first hook key registered after the plan's profile: hooks of that key or later are no
            hooks the profile measured (NOTE [ Hooks the profile did not see ]); ``None``: every hook there now is.

    Returns:
        Every module whose ``forward`` was overridden.

    Raises:
        RematError: If a module already belongs to another applied plan (nothing is installed then).
    """
    if reuse is not None and ops in reuse:
        for module, role in reuse[ops]:
            _set_role(module, role)
        return [module for module, _ in reuse[ops]]
    roles: dict[int, tuple[nn.Module, str, list[tuple[_Span, int]]]] = {}
    policies: dict[int, frozenset[str]] = {}
    _assign(model, ops, members, names, roles, policies)
    touched: list[nn.Module] = []
    sharded = any(_is_fsdp(m) for m in model.modules())  # NOTE [ Parameters under recomputation ]
    try:
        for module, name, spans in roles.values():
            role = _Role(
                tuple(spans), module.__dict__.get("forward"), name, allow_stateful, policy=policies.get(id(module))
            )
            role.check_params = not sharded
            role.allow_hooks = allow_hooks
            role.root = weakref.ref(model)
            # NOTE [ Hooks added after apply ], NOTE [ Hooks the profile did not see ]
            role.hook_keys = {
                k for k in (*module._forward_pre_hooks, *module._forward_hooks) if hooks_from is None or k < hooks_from
            }
            _set_role(module, role)
            touched.append(module)
    except BaseException:
        uninstall(touched)
        raise
    if sizes is not None:
        _install_size_checks(members, names, sizes)
    if reuse is not None:
        reuse[ops] = [(module, module.__dict__["_remat_role"]) for module in touched]
    return touched


def _install_size_checks(
    members: Sequence[list[nn.Module]], names: Sequence[tuple[str, ...]], sizes: InputSizes
) -> None:
    """A :class:`SizeCheck` on the role of each block's first member, and, where the first block taking inputs of
    a size no earlier block took (block 0; a decoder's first layer after an encoder's) has no role on its first
    member (kept, or kept with a sub-module recomputed), one as its forward pre-hook: its input tells the batch,
    or that stack's share of it, in every step (NOTE [ Batches larger than the profiled one ])."""
    seen: set[int] = set()
    for k, group in enumerate(members[: len(sizes.input_bytes)]):
        role = group[0].__dict__.get("_remat_role")
        if role is not None:
            role.size_check = SizeCheck(sizes, k, names[k][0])
        elif sizes.input_bytes[k] not in seen:
            group[0].register_forward_pre_hook(SizeCheck(sizes, k, names[k][0]), with_kwargs=True)
            sizes.hooked.append(group[0])
        seen.add(sizes.input_bytes[k])


def _remove_size_hook(sizes: InputSizes | None) -> None:
    """Remove the forward pre-hooks :func:`_install_size_checks` registered, if any."""
    if sizes is None:
        return
    for module in sizes.hooked:
        for key in [k for k, hook in module._forward_pre_hooks.items() if isinstance(hook, SizeCheck)]:
            del module._forward_pre_hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)
    sizes.hooked = []


# What a role's learning call finds (NOTE [ State under recomputation ]): facts about its modules' forward,
# whichever way a plan runs them (the fields ``_Role.__getstate__`` resets).
_LEARNED_FIELDS = (
    "learned",
    "learned_training",
    "stateful",
    "norms",
    "generators",
    "param_slots",
    "py_rng",
    "fills_saved",
    "attrs",
    "plain_names",
    "reads",
)


def share_learning(source: Sequence[tuple[nn.Module, _Role]], target: Sequence[tuple[nn.Module, _Role]]) -> bool:
    """Give each role in ``target`` (``install``'s ``reuse`` entry) what the role of the same module in
    ``source`` learned, so that its first call does not learn again (NOTE [ One learning forward ] in
    ``remat.profile.profiler``). All or nothing: ``False``, and nothing changed, where a module of
    ``target`` has no role in ``source`` or one that has not learned."""
    learned = {id(module): role for module, role in source if role.learned}
    if any(id(module) not in learned for module, _ in target):
        return False
    for module, role in target:
        for name in _LEARNED_FIELDS:
            setattr(role, name, getattr(learned[id(module)], name))
    return True


def uninstall(modules: Sequence[nn.Module]) -> None:
    """Restore the original ``forward`` of every module :func:`install` touched."""
    for module in modules:
        role = module.__dict__.pop("_remat_role", None)
        if role is None:
            continue
        if role.previous_forward is not None:
            module.__dict__["forward"] = role.previous_forward
        else:
            module.__dict__.pop("forward", None)


# What is installed on a model lives on the model itself (a plain attribute, not in the state_dict), so
# it travels with copy.deepcopy and pickling. ``tag`` is the value it was installed for (the apply
# stage's Plan); the rest is what it takes to install it again.
_APPLIED_ATTR = "_remat_applied"


@dataclass(frozen=True)
class Attached:
    """An installation on a model: what :func:`attach` installed, and how to install it again."""

    tag: Any
    ops: tuple[Op, ...]
    names: tuple[tuple[str, ...], ...]
    allow_stateful: bool
    touched: tuple[nn.Module, ...]
    allow_hooks: bool = False
    sizes: InputSizes | None = None  # NOTE [ Batches larger than the profiled one ]
    trainable: Trainable | None = None  # NOTE [ Parameters unfrozen after planning ] in remat.blocks
    hooks: HookWatch | None = None  # NOTE [ Hooks the profile did not see ]


def holder(model: nn.Module) -> nn.Module:
    """The module whose ``__dict__`` holds the installation: a DDP wrapper's module when it was made on the
    unwrapped model (NOTE [ Wrapped models ] in ``remat.core.wrapped``)."""
    return model if _APPLIED_ATTR in model.__dict__ else unwrap(model)


def attach(
    model: nn.Module,
    tag: Any,
    ops: tuple[Op, ...],
    members: Sequence[list[nn.Module]],
    names: Sequence[tuple[str, ...]],
    *,
    allow_stateful: bool = False,
    allow_hooks: bool = False,
    sizes: InputSizes | None = None,
    trainable: Trainable | None = None,
    hooks: HookWatch | None = None,
) -> None:
    """:func:`install` ``ops`` on ``model`` in place of what was there, and remember it under ``tag``
    (``sizes``: the profiled batch's, checked at run time: NOTE [ Batches larger than the profiled one ];
    ``trainable``: the profile's parameters requiring grad, checked once per forward: NOTE [ Parameters
    unfrozen after planning ] in ``remat.blocks``; ``hooks``: the hooks registered since the plan's profile,
    checked: NOTE [ Hooks the profile did not see ])."""
    detach(model)
    touched = install(
        model,
        ops,
        members,
        names,
        allow_stateful=allow_stateful,
        allow_hooks=allow_hooks,
        sizes=sizes,
        hooks_from=hooks.since if hooks is not None else None,
    )
    model.__dict__[_APPLIED_ATTR] = Attached(
        tag, tuple(ops), tuple(map(tuple, names)), allow_stateful, tuple(touched), allow_hooks, sizes, trainable, hooks
    )
    model.register_forward_hook(_check_members)
    model.register_forward_pre_hook(_watch_hooks)


# NOTE [ Hooks added after apply ]
# A forward hook that returns another tensor than the module's output (``o * 0.5``), or a pre-hook that returns
# other inputs, puts a new tensor between two members of a segment: the next member's input is no longer the
# previous member's output, which the segment replays (a link, NOTE [ Spans ]), but a tensor it must hold.
# The profile measures that for the hooks registered when it runs; registered after apply, the plan was made
# without it: gradients exact, but a multi-block segment held each such input, 1.07-1.09x the plan's
# prediction and budget, silently (helper-119). A hook that returns nothing, what it was given or aliases of it
# (a logging hook, FSDP2's hooks, remat's own timeline) changes nothing, so presence is not the
# test: before each forward of the model, a hook new since apply on a module where it could break a link
# (a forward hook where a later member of a span may take the output, a pre-hook where the module's inputs
# may be an earlier member's output) is wrapped in a check of what it returns (_CheckedHook), and one that
# returns other tensors raises there, before any backward. Hooks at install are the profile's and are left
# alone; the wrappers are taken off again by remat.remove. Per forward, a module with no hooks costs two
# dict tests.


class _CheckedHook:
    """A forward (pre-)hook registered on a planned module after apply, run as it is but refused where it
    returns other tensors than it was given (NOTE [ Hooks added after apply ])."""

    __slots__ = ("__wrapped__", "name", "pre")

    def __init__(self, hook: Callable[..., Any], name: str, pre: bool) -> None:
        self.__wrapped__, self.name, self.pre = hook, name, pre

    def __call__(self, *args: Any) -> Any:
        result = self.__wrapped__(*args)
        if result is None:
            return None
        given = args[1:] if self.pre else args[-1]  # (args[, kwargs]) of a pre-hook, the output of a forward hook
        # Module.__call__ takes a pre-hook's lone value (no kwargs) as the only argument.
        taken = (result,) if self.pre and len(args) == 2 and not isinstance(result, tuple) else result
        if self.pre and len(args) == 2:
            given = given[0]
        if _tensor_ids(taken) == _tensor_ids(given):
            return result
        kind = "forward pre-hook" if self.pre else "forward hook"
        what = "inputs than the module was called with" if self.pre else "tensors than the module returned"
        raise RematError(
            f"apply: module {self.name!r} got a {kind} after the plan's profile (after remat.apply, or between "
            "remat.profile and remat.apply: NOTE [ Hooks the profile did not see ]) "
            f"({getattr(self.__wrapped__, '__qualname__', type(self.__wrapped__).__name__)}) that returns other "
            f"{what}; the plan recomputes it in one segment with "
            f"{'the module whose output it takes' if self.pre else 'a later module that takes its output'}, "
            "a link the plan's profile measured without the hook (the segment would hold the new tensor, above "
            "the plan's budget); register the hook before remat.profile and plan again (the "
            "profile measures what it changes), or remat.remove(model) while it is registered"
        )


def _tensor_ids(tree: Any) -> list[tuple[int, int]]:
    """The storages of ``tree``'s tensors, by address and size: a hook that returns aliases of what it was
    given (FSDP2's pre-forward hook, which passes the inputs through an autograd function that registers its
    post-backward hook) holds no new memory (NOTE [ Hooks added after apply ]); a tensor without a storage
    (sparse, nested) counts by identity."""
    keys: list[tuple[int, int]] = []
    for t in output_leaves(tree):
        if not isinstance(t, torch.Tensor):
            continue
        try:
            st = t.untyped_storage()
            keys.append((st.data_ptr(), st.nbytes()))
        except (RuntimeError, NotImplementedError):
            keys.append((id(t), -1))
    return keys


def _link_positions(role: _Role) -> tuple[bool, bool]:
    """Whether a later member of one of ``role``'s spans may take the module's output, and whether its inputs
    may be an earlier member's output."""
    return any(pos < span.size - 1 for span, pos in role.spans), any(pos > 0 for span, pos in role.spans)


def _watch_hooks(model: nn.Module, _args: Any) -> None:
    """Before each forward of a model with a plan attached: wrap the forward (pre-)hooks registered on its
    planned modules since apply where they could break a link (NOTE [ Hooks added after apply ])."""
    if torch.compiler.is_compiling():
        return
    entry = model.__dict__.get(_APPLIED_ATTR)
    if not isinstance(entry, Attached):
        return
    trainable = entry.trainable
    if trainable is not None and not trainable.warned and torch.is_grad_enabled():
        trainable.check()  # NOTE [ Parameters unfrozen after planning ] in remat.blocks: once per forward
    for module in entry.touched:
        pre_hooks, hooks = module._forward_pre_hooks, module._forward_hooks
        if not pre_hooks and not hooks:
            continue
        role = module.__dict__.get("_remat_role")
        if role is None:
            continue
        known = role.hook_keys
        if all(k in known for k in pre_hooks) and all(k in known for k in hooks):
            continue
        out_linked, in_linked = _link_positions(role)
        for hook_dict, pre, linked in ((pre_hooks, True, in_linked), (hooks, False, out_linked)):
            for key in [k for k in hook_dict if k not in known]:
                known.add(key)
                if linked and not isinstance(hook_dict[key], _CheckedHook):
                    hook_dict[key] = _CheckedHook(hook_dict[key], role.name, pre)
        known.intersection_update({*pre_hooks, *hooks})  # forget removed hooks
    watch = entry.hooks
    if watch is not None and not watch.warned and (RemovableHandle.next_id, HookWatch.unwrapped) != watch.seen:
        watch.wrap_new(model)  # NOTE [ Hooks the profile did not see ]: only when a hook was registered anywhere


def _unwatch_hooks(modules: Iterable[nn.Module], watch: HookWatch | None = None) -> None:
    """Put back the hooks :func:`_watch_hooks` wrapped (and those ``watch`` wrapped in ``modules`` and the
    global hook dicts)."""
    dicts = [d for module in modules for d in (module._forward_pre_hooks, module._forward_hooks)]
    if watch is not None:
        dicts += [module_globals._global_forward_pre_hooks, module_globals._global_forward_hooks]
    for hook_dict in dicts:
        for key, hook in list(hook_dict.items()):
            was = hook
            while isinstance(hook, (_CheckedHook, _SavesChecked)) and (
                not isinstance(hook, _SavesChecked) or hook.watch is watch
            ):
                hook = hook.__wrapped__
            hook_dict[key] = hook
            if hook is not was and isinstance(was, _SavesChecked) and was.is_global:
                # Another applied plan skipped this global hook as wrapped already: it walks again.
                HookWatch.unwrapped += 1


# NOTE [ Hooks the profile did not see ]
# A plan counts what the model saved when its profile ran, with the hooks registered then. A forward hook
# registered later that computes with what it is given saves more for the backward (``o * o.sigmoid()`` on a
# kept layer's output saves the sigmoid): on the built-in GPT and a Llama from config, such hooks on every
# layer (or split member) peaked at 1.08-1.66x the plan's budget, on every layer's MLP at up to 1.14x,
# gradients exact, silently, whether the hook was module-level or global, registered after apply or between
# remat.profile and remat.apply (helper-127). A hook that saves nothing new (logging, ``o * 0.5``: a product
# with a number saves nothing, FSDP2's and remat's own hooks) changes nothing, so presence is not the test (NOTE [ Hooks
# added after apply ]). torch numbers every hook handle from one counter (``RemovableHandle.next_id``), which
# is also each hook's key in its dict: ``remat.profile`` notes the counter for the model when it ends
# (``note_profiled``), and a hook of that key or later, on any module of the model or global, was not seen
# by the plan's profile (without a note for this model, e.g. a plan read from a file or made on a copy:
# hooks registered after apply). Before
# a forward of the applied model in which the counter moved since the last look (one integer comparison
# otherwise), ``HookWatch.wrap_new`` walks the model's modules and the global hook dicts and wraps each such
# hook in ``_SavesChecked``, which runs it and, on its first call per module, follows the autograd graph
# from what it returns back to what it was given and adds up the storages it saves that are neither those
# given nor the module's parameters and buffers. When that sum over a step's new hooks exceeds 1/32 of the
# plan's budget (``_SLACK``, as a larger batch), the planned model warns once (``RematWarning``). A
# global hook on a planned module at a link is also checked as NOTE [ Hooks added after apply ] checks one on
# the module; such module hooks registered between the profile and apply are no longer taken as the
# profile's. Not seen: a hook registered and removed within one forward (the walk runs before the
# forward), a hook that keeps tensors without returning them (a feature collector, no autograd edge), and a
# hook inside a member remat records (saved-tensor hooks active: its saves are the segment's, and reading
# them would run remat's unpacking); ``remat.remove`` puts the hooks back. Cost: 0.06 us per forward with no
# new hook; one walk (80 us on a 4-layer GPT) when one was registered; a wrapped hook 3 us more per call, and
# its first call per module a graph walk (about 0.2 ms).
@dataclass(eq=False)
class HookWatch:
    """The hooks registered since a plan's profile and what they save, for one applied plan (NOTE [ Hooks the
    profile did not see ])."""

    since: int  # the first hook key the profile did not see
    strategy: str
    limit_bytes: int  # bytes of new saved tensors per step that warn: 1/_SLACK of the budget
    budget: str  # for the message: "its budget 1.2MiB"
    seen: tuple[int, int] = (-1, -1)  # (RemovableHandle.next_id, HookWatch.unwrapped) at the last walk
    saved_bytes: int = 0  # what the new hooks saved, on their first call per module
    names: dict[int, str] = field(default_factory=dict)  # id(module) -> FQN, at the last walk
    warned: bool = False
    # Global hooks put back by a plan's removal so far: a global hook one applied plan wrapped, every other one
    # skipped; when that plan is removed, the others walk again and wrap it for themselves.
    unwrapped: ClassVar[int] = 0

    def wrap_new(self, model: nn.Module) -> None:
        """Wrap every forward (pre-)hook of ``model``'s modules and the global ones registered since the profile."""
        self.seen = (RemovableHandle.next_id, HookWatch.unwrapped)
        self.names = {}
        for name, module in model.named_modules():
            self.names[id(module)] = name
            if module._forward_pre_hooks or module._forward_hooks:
                self._wrap(module._forward_pre_hooks, True, False)
                self._wrap(module._forward_hooks, False, False)
        self._wrap(module_globals._global_forward_pre_hooks, True, True)
        self._wrap(module_globals._global_forward_hooks, False, True)

    def _wrap(self, hook_dict: dict[int, Callable[..., Any]], pre: bool, is_global: bool) -> None:
        for key, hook in list(hook_dict.items()):
            if key >= self.since and not _own_hook(hook):
                hook_dict[key] = _SavesChecked(hook, self, pre, is_global)

    def add(self, nbytes: int, module: nn.Module, hook: Callable[..., Any], pre: bool) -> None:
        """Count what a hook saved; warn once when the step's new hooks together save above the limit."""
        self.saved_bytes += nbytes
        if self.saved_bytes <= self.limit_bytes:
            return
        self.warned = True
        name = self.names.get(id(module), type(module).__name__)
        warnings.warn(
            RematWarning(
                f"apply: a forward {'pre-' if pre else ''}hook registered after the plan's profile "
                f"({getattr(hook, '__qualname__', type(hook).__name__)}, on module {name!r}) saves "
                f"{format_bytes(nbytes)} for the backward that the plan {self.strategy} did not count "
                f"({format_bytes(self.saved_bytes)} with the other hooks registered since), so this step can peak "
                f"above {self.budget} (measured up to 1.66x; gradients stay exact); register the hook before "
                "remat.profile and plan again (warned once per applied plan)"
            ),
            stacklevel=_caller_level(),
        )


class _SavesChecked:
    """A forward (pre-)hook registered since a plan's profile, run as it is, with what it saves for the backward
    counted on its first call per module (NOTE [ Hooks the profile did not see ])."""

    __slots__ = ("__wrapped__", "done", "is_global", "pre", "watch")

    def __init__(self, hook: Callable[..., Any], watch: HookWatch, pre: bool, is_global: bool) -> None:
        self.__wrapped__, self.watch, self.pre, self.is_global = hook, watch, pre, is_global
        self.done: set[int] = set()  # ids of the modules it was checked on

    def __call__(self, module: nn.Module, *rest: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.__wrapped__(module, *rest)
        role = module.__dict__.get("_remat_role") if self.is_global else None
        if role is not None and _link_positions(role)[1 if self.pre else 0]:
            # A global hook at a link of a planned module: NOTE [ Hooks added after apply ].
            result = _CheckedHook(self.__wrapped__, role.name, self.pre)(module, *rest)
        else:
            result = self.__wrapped__(module, *rest)
        watch = self.watch
        if result is None or watch.warned or id(module) in self.done or not torch.is_grad_enabled():
            return result
        self.done.add(id(module))
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            return result  # inside a recorded member, or the caller's own saved-tensor hooks: not ours to read
        nbytes = _new_saved_bytes(result, rest, module)
        if nbytes:
            watch.add(nbytes, module, self.__wrapped__, self.pre)
        return result


def _new_saved_bytes(result: Any, given: Any, module: nn.Module, max_nodes: int = 256) -> int:
    """Bytes of the storages that the autograd graph from ``result`` back to ``given`` saves, other than those
    of ``given`` and of ``module``'s parameters and buffers (NOTE [ Hooks the profile did not see ])."""
    known: set[int] = set()
    stop: set[int] = set()
    for t in (*output_leaves(given), *module.parameters(), *module.buffers()):
        if isinstance(t, torch.Tensor):
            try:
                known.add(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                continue
            if t.grad_fn is not None:
                stop.add(id(t.grad_fn))
    todo: list[Any] = [
        t.grad_fn for t in output_leaves(result) if isinstance(t, torch.Tensor) and t.grad_fn is not None
    ]
    visited: set[int] = set()
    found: dict[int, int] = {}
    while todo and len(visited) < max_nodes:
        node = todo.pop()
        if node is None or id(node) in visited or id(node) in stop:
            continue
        visited.add(id(node))
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    value = getattr(node, attr)
                except RuntimeError:
                    continue
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor):
                        try:
                            st = t.untyped_storage()
                        except (RuntimeError, NotImplementedError):
                            continue
                        if st.data_ptr() not in known:
                            found[st.data_ptr()] = st.nbytes()
        todo.extend(fn for fn, _ in node.next_functions)
    return sum(found.values())


# Per model, RemovableHandle.next_id when its last remat.profile ended (NOTE [ Hooks the profile did not see ]).
_PROFILED: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def note_profiled(model: nn.Module) -> None:
    """Note that ``model`` was profiled now: hooks registered later are none its profile measured."""
    _PROFILED[model] = RemovableHandle.next_id


def hook_watch(
    model: nn.Module, strategy: str, budget_bytes: int | None, predicted_peak_bytes: int | None
) -> HookWatch | None:
    """The :class:`HookWatch` of a plan applied to ``model`` now; ``None`` for a plan with no predicted peak."""
    limit = budget_bytes if budget_bytes is not None else predicted_peak_bytes
    if limit is None:
        return None
    since = _PROFILED.get(model, _PROFILED.get(unwrap(model), RemovableHandle.next_id))
    what = "its budget" if budget_bytes is not None else "its predicted peak"
    return HookWatch(since, strategy, limit // _SLACK, f"{what} {format_bytes(limit)}")


def _check_members(model: nn.Module, _args: Any, _output: Any) -> None:
    """After each forward of a model with a plan attached: every module the plan runs is still the one at its
    name. A model may replace one after ``apply`` (HF BigBird swaps each ``attention.self`` for another
    object on its first forward when the sequence is too short for block-sparse attention): the plan would
    run the old one, which nothing calls, and the step would peak above the plan's budget, silently
    (1.10-1.46x on BigBird before this check). Likewise its ``forward``: NOTE [ A forward assigned after
    apply ]."""
    if torch.compiler.is_compiling():  # traced away: a compiled model's plan is checked by its eager calls
        return
    entry = model.__dict__.get(_APPLIED_ATTR)
    if not isinstance(entry, Attached):
        return
    for module in entry.touched:
        role = module.__dict__.get("_remat_role")
        if role is None:
            continue
        try:
            here: nn.Module | None = model.get_submodule(role.name)
        except AttributeError:
            here = None
        if here is not module:
            raise RematError(
                f"apply: module {role.name!r} was replaced in the model after remat.apply (now "
                f"{'absent' if here is None else type(here).__name__}), so the plan runs a module the model no longer calls and the step is not "
                "planned; call the model once before remat.apply (it builds its modules on its first call), or "
                "apply the plan again"
            )
        forward = module.__dict__.get("forward")
        if not (isinstance(forward, _Dispatch) and forward.module is module):
            raise RematError(
                f"apply: module {role.name!r} had its forward assigned after remat.apply (module.forward = "
                f"{getattr(forward, '__qualname__', type(forward).__name__)}), which replaced the forward remat "
                "installed, so the plan no longer runs that module and the step is not planned; assign the forward "
                "before remat.apply (remat then runs the one assigned) and do not assign it again in the model's "
                "forward, or remat.remove the plan and apply it again after assigning it"
            )


# NOTE [ A forward assigned after apply ]
# remat runs a planned module through the instance ``forward`` it installs (_Dispatch). Code that assigns
# ``module.forward = fn`` after apply (a patch for inference, a partial with another scale, or a model
# whose forward binds a closure to each layer on every call) replaces it: the module then runs plainly,
# gradients stay exact, but nothing is recomputed and the step peaked at 1.45-1.83x the plan's
# prediction, silently (helper-119). Checked with the modules after each forward of the model, before
# any backward.


def attached(model: nn.Module) -> Attached | None:
    """What :func:`attach` installed on ``model`` (or on the module a DDP wrapper holds), if anything."""
    entry = holder(model).__dict__.get(_APPLIED_ATTR)
    return entry if isinstance(entry, Attached) else None


def detach(model: nn.Module) -> Any | None:
    """Undo :func:`attach`; returns its ``tag`` (``None`` when nothing was attached)."""
    host = holder(model)
    entry = host.__dict__.get(_APPLIED_ATTR)
    if isinstance(entry, Attached) and entry.hooks is not None:
        _unwatch_hooks(host.modules(), entry.hooks)  # NOTE [ Hooks the profile did not see ]
    for key in [k for k, hook in host._forward_hooks.items() if hook is _check_members]:
        del host._forward_hooks[key]
    for key in [k for k, hook in host._forward_pre_hooks.items() if hook is _watch_hooks]:
        del host._forward_pre_hooks[key]
    entry = host.__dict__.pop(_APPLIED_ATTR, None)
    if not isinstance(entry, Attached):
        return None
    _unwatch_hooks(entry.touched)
    uninstall(entry.touched)
    _remove_size_hook(entry.sizes)
    return entry.tag


@contextlib.contextmanager
def suspended(model: nn.Module) -> Iterator[None]:
    """Run the model plain inside the block (e.g. to profile it), then install again what was attached."""
    host = holder(model)
    entry = attached(host)
    detach(host)
    try:
        yield
    finally:
        if entry is not None:
            members = [[host.get_submodule(f) for f in fqns] for fqns in entry.names]
            attach(
                host,
                entry.tag,
                entry.ops,
                members,
                entry.names,
                allow_stateful=entry.allow_stateful,
                allow_hooks=entry.allow_hooks,
                sizes=entry.sizes,
                trainable=entry.trainable,
                hooks=entry.hooks,
            )


def nested_plans(model: nn.Module) -> list[tuple[str, nn.Module, Attached]]:
    """Plans attached to modules inside ``model`` other than its own holder: ``remat.apply`` or
    ``hf.enable`` called on a model that was wrapped afterwards (PEFT's ``get_peft_model``), as
    ``(name, module, installation)``."""
    host = holder(model)
    out = []
    for name, module in host.named_modules():
        entry = module.__dict__.get(_APPLIED_ATTR)
        if module is not host and isinstance(entry, Attached):
            out.append((name, module, entry))
    return out


def is_applied_module(module: nn.Module) -> bool:
    """Whether remat runs ``module`` (it belongs to an applied plan's span)."""
    return "_remat_role" in module.__dict__


class _FnModule(nn.Module):
    """A function as a module, so that the modules it is, is bound to or closes over are its children
    (their buffers are then covered by NOTE [ State under recomputation ])."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn
        owners: list[nn.Module] = []
        if isinstance(fn, nn.Module):
            owners.append(fn)
        elif isinstance(getattr(fn, "__self__", None), nn.Module):
            owners.append(fn.__self__)  # type: ignore[attr-defined,union-attr]
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if isinstance(value, nn.Module):
                owners.append(value)
        self.owners = nn.ModuleList(dict.fromkeys(owners))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def run_function(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``fn(*args, **kwargs)`` as a one-call span (``remat.checkpoint``)."""
    module = _FnModule(fn)
    name = getattr(fn, "__qualname__", type(fn).__name__)
    role = _Role(((_Span(name, 1), 0),), None, name)
    return _invoke(module, role, role.spans, args, kwargs, replay=False)


@contextlib.contextmanager
def count_forwards(first_members: Sequence[nn.Module]) -> Iterator[dict[int, int]]:
    """Count how often each module's forward runs: calls by the model and replays in the backward.

    Yields:
        A dict from ``id(module)`` to the number of forward runs so far.
    """
    counts = {id(m): 0 for m in first_members}
    handles = [m.register_forward_pre_hook(lambda mod, _args: _count(mod)) for m in first_members]
    previous = _LOCAL.counts
    _LOCAL.counts = counts
    try:
        yield counts
    finally:
        _LOCAL.counts = previous
        for h in handles:
            h.remove()


@contextlib.contextmanager
def observed(observer: Observer) -> Iterator[None]:
    """Report every replayed forward run (those bypass module hooks): ``observer(module, started, raised)``."""
    previous = _LOCAL.observer
    _LOCAL.observer = observer
    try:
        yield
    finally:
        _LOCAL.observer = previous


def _own_hook(hook: object) -> bool:
    """Whether ``hook`` is one remat registers itself, or one ``HookWatch`` wrapped already (NOTE [ Hooks the
    profile did not see ])."""
    return hook is _check_members or hook is _watch_hooks or isinstance(hook, (_SavesChecked, SizeCheck))
