"""Executing plan operations on a live model through ``torch.utils.checkpoint``.

# NOTE [ Spans ]
A ``Recompute(a, b, inner)`` covers blocks ``a..b-1``, i.e. one or more member modules that the
user's own ``forward`` calls one after another. remat leaves the model's code alone and overrides the
instance ``forward`` of each member (parameters, state_dict keys and module identity are untouched):
the *first* member runs the whole span under one non-reentrant ``checkpoint`` and the *other* members
pass its output through. Inside the span the runner calls each kept member's original ``forward``
directly, and each inner ``Recompute`` through a nested ``checkpoint``. Members after the first get the
previous member's output as first argument and the span's other arguments unchanged (the
``for layer in layers: x = layer(x, mask)`` pattern).

That is only right if the model really calls the members as that chain, so every pass-through call is
checked, and a model that does anything else gets a ``RematError`` instead of wrong values: its first
argument must be the tensor the span produced (identity) and unmodified since (``_version``), its
other arguments the very objects the span was called with, and the members must be called once each,
in order. The per-forward state lives in a thread-local, so threads do not see each other's spans.

Module hooks run once per call the model makes, outside the checkpoint (as when the user calls a
module wrapped by ``checkpoint``): the runner calls original forwards directly, so a recomputation
does not run them again. Hooks of members after the first see the pass-through call (input is the
span's output, and so is the output).

# NOTE [ BatchNorm under recomputation ]
A recomputed forward runs BatchNorm in training mode again, so torch would update the running
statistics twice. Every recomputation (each call of a checkpointed function after the first) snapshots
the running statistics of every BatchNorm that runs in it (the span's own, and through a global
module pre-hook any other, e.g. inside ``remat.checkpoint(fn)``) and restores them afterwards, also
when torch stops the recomputation early by raising.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from remat.errors import RematError
from remat.plan.chain import Keep, Op, Recompute, RecomputeSub

__all__ = ["install", "uninstall", "count_forwards", "run_checkpointed", "observed"]

# Keywords torch.utils.checkpoint takes for itself: read from its signature, not typed by hand, plus
# preserve_rng_state, which it pops from **kwargs (so the signature does not show it).
_CHECKPOINT_KWARGS = frozenset(
    name for name, p in inspect.signature(torch_checkpoint).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
) | {"preserve_rng_state"}

Observer = Callable[[nn.Module, bool, bool], None]


class _Local(threading.local):
    counts: dict[int, int] | None = None
    observer: Observer | None = None


_LOCAL = _Local()


class _Progress(threading.local):
    """Per-thread state of one span during a forward: what it produced and which member comes next."""

    output: Any = None  # weakref to the span's output tensor
    version: int = -1
    extra: tuple[Any, ...] | None = None  # the span's other arguments, held until its last member (ids stay valid)
    next_pos: int | None = None


class _Span:
    """One checkpointed region: its operations and the member modules of each block it covers."""

    def __init__(self, ops: tuple[Op, ...], members: dict[int, list[nn.Module]], size: int) -> None:
        self.ops = ops
        self.members = members
        self.size = size  # member modules in the span
        self.progress = _Progress()

    def __getstate__(self) -> dict[str, Any]:
        # The per-forward state is neither picklable nor worth keeping.
        return {k: v for k, v in self.__dict__.items() if k != "progress"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.progress = _Progress()

    def batchnorms(self) -> list[nn.Module]:
        return [m for mods in self.members.values() for top in mods for m in top.modules() if isinstance(m, _BatchNorm)]


@dataclass(eq=False)
class _Role:
    span: _Span
    position: int  # 0: runs the span; > 0: passes the span's output through
    previous_forward: Any  # an instance ``forward`` the module had before remat, or None
    name: str


class _Dispatch:
    """The instance ``forward`` remat installs: a picklable callable, not a bound method."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _span_forward(self.module, args, kwargs)


def _original(module: nn.Module) -> Callable[..., Any]:
    role = module.__dict__.get("_remat_role")
    if role is None:
        return module.forward
    return role.previous_forward if role.previous_forward is not None else type(module).forward.__get__(module)


def _run_member(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # A real run of the member's own forward: counted, and reported to an observer (remat.timeline).
    _count(module, +1)
    observer = _LOCAL.observer
    if observer is not None:
        observer(module, True, False)
    raised = True
    try:
        out = _original(module)(*args, **kwargs)
        raised = False
        return out
    finally:
        if observer is not None:
            observer(module, False, raised)


@contextlib.contextmanager
def _frozen_batchnorm(known: Sequence[nn.Module]) -> Iterator[None]:
    # NOTE [ BatchNorm under recomputation ]
    saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def snapshot(module: nn.Module, *_: Any) -> None:
        if isinstance(module, _BatchNorm) and module.training and module.track_running_stats and id(module) not in saved:
            buffers = [getattr(module, n) for n in ("running_mean", "running_var", "num_batches_tracked")]
            saved[id(module)] = [(b, b.detach().clone()) for b in buffers if isinstance(b, torch.Tensor)]

    for bn in known:
        snapshot(bn)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(snapshot)
    try:
        yield
    finally:
        handle.remove()
        with torch.no_grad():
            for pairs in saved.values():
                for buf, copy in pairs:
                    buf.copy_(copy)


def _run_ops(ops: tuple[Op, ...], span: _Span, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out: Any = None
    first = True
    for op in ops:
        if not first:
            args = (out, *args[1:])
        first = False
        if isinstance(op, (Keep, RecomputeSub)):
            # A RecomputeSub's sub-modules carry their own checkpoint (installed by install()).
            for i, module in enumerate(span.members[op.index]):
                if i:
                    args = (out, *args[1:])
                out = _run_member(module, args, kwargs)
        else:
            out = run_checkpointed(op.inner, span, args, kwargs)
    return out


def run_checkpointed(ops: tuple[Op, ...], span: _Span, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``ops`` of ``span`` under one non-reentrant checkpoint (or plainly when grad is off)."""
    if not torch.is_grad_enabled():
        return _run_ops(ops, span, args, kwargs)
    clash = _CHECKPOINT_KWARGS.intersection(kwargs)
    if clash:
        raise RematError(
            f"apply: the block takes keyword argument(s) {sorted(clash)} that torch.utils.checkpoint reserves; "
            "pass them positionally or rename them"
        )
    calls = 0

    def fn(*a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return _run_ops(ops, span, a, kw)
        with _frozen_batchnorm(span.batchnorms()):
            return _run_ops(ops, span, a, kw)

    return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _count(module: nn.Module, delta: int) -> None:
    counts = _LOCAL.counts
    if counts is not None and id(module) in counts:
        counts[id(module)] += delta


def _extra_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A call's arguments after the first, to compare by identity with ``same_args``.

    Tensors are held by weak reference (holding them would lengthen their life and change the memory
    being measured); other objects are held, so that their ids cannot be reused meanwhile.
    """
    items = [("", a) for a in args[1:]] + sorted(kwargs.items(), key=lambda kv: kv[0])
    return tuple((k, weakref.ref(v) if isinstance(v, torch.Tensor) else v) for k, v in items)


def same_args(held: tuple[tuple[str, Any], ...] | None, now: tuple[tuple[str, Any], ...]) -> bool:
    """Whether two ``_extra_args`` are the very same objects (identity, not equality)."""
    if held is None or len(held) != len(now):
        return False
    for (k1, v1), (k2, v2) in zip(held, now):
        if k1 != k2:
            return False
        if isinstance(v1, weakref.ref) and isinstance(v2, weakref.ref):
            if v1() is None or v1() is not v2():
                return False
        elif v1 is not v2:
            return False
    return True


def _not_a_chain(name: str, why: str) -> RematError:
    return RematError(
        f"apply: module {name!r} {why}, so this model does not call these blocks as a chain and they cannot "
        "share one checkpointed segment; use a plan whose segments hold one block each (e.g. strategy 'full' "
        "or solver 'knapsack')"
    )


def _span_forward(self: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    role: _Role = self.__dict__["_remat_role"]
    _count(self, -1)  # this call dispatches or passes through; the real forward is counted when it runs
    span, progress = role.span, role.span.progress
    if role.position > 0:
        expected = progress.output() if progress.output is not None else None
        first = args[0] if args else None
        if progress.next_pos != role.position:
            raise _not_a_chain(role.name, "was called out of turn (twice, or before the module before it)")
        if expected is None or first is not expected:
            raise _not_a_chain(role.name, "was called with something other than the output of the module before it")
        if first._version != progress.version:
            raise _not_a_chain(role.name, "received the previous module's output modified in place")
        if not same_args(progress.extra, _extra_args(args, kwargs)):
            raise _not_a_chain(role.name, "was called with other arguments than the module before it")
        progress.next_pos = role.position + 1 if role.position + 1 < span.size else None
        if progress.next_pos is None:
            progress.extra = None  # the last member: stop holding the arguments
        return first
    if span.size == 1:
        return run_checkpointed(span.ops, span, args, kwargs)
    try:
        out = run_checkpointed(span.ops, span, args, kwargs)
    except RematError:
        raise
    except Exception as e:
        # The runner calls later members with this call's other arguments (NOTE [ Spans ]); a model
        # that passes them something else can fail there before any pass-through check could run.
        raise RematError(
            f"apply: the segment starting at {role.name!r} failed running its {span.size} modules one after another "
            f"({type(e).__name__}: {e}); if the model does not call them as a chain with the same other arguments, "
            "use a plan whose segments hold one block each (e.g. strategy 'full' or solver 'knapsack')"
        ) from e
    if span.size > 1:
        if not isinstance(out, torch.Tensor):
            raise RematError(
                f"apply: module {role.name!r} starts a segment of several modules but returns {type(out).__name__}; "
                "multi-module segments need modules that take and return one tensor"
            )
        progress.output = weakref.ref(out)
        progress.version = out._version
        progress.extra = _extra_args(args, kwargs)
        progress.next_pos = 1
    return out


def _set_role(module: nn.Module, role: _Role) -> None:
    if "_remat_role" in module.__dict__:
        raise RematError(
            f"apply: module {role.name!r} is already part of another checkpointed segment (a plan applied to it or "
            "to a module around it); remove that plan first"
        )
    module.__dict__["_remat_role"] = role
    module.__dict__["forward"] = _Dispatch(module)


def _sub_ops(ops: tuple[Op, ...]) -> Iterator[RecomputeSub]:
    for op in ops:
        if isinstance(op, RecomputeSub):
            yield op
        elif isinstance(op, Recompute):
            yield from _sub_ops(op.inner)


def install(
    model: nn.Module, ops: tuple[Op, ...], members: Sequence[list[nn.Module]], names: Sequence[tuple[str, ...]]
) -> list[nn.Module]:
    """Install the top-level operations ``ops`` on ``model``'s modules (all or nothing).

    Args:
        model: The model (used for sub-module lookup).
        ops: Top-level plan operations over blocks ``0..n-1``.
        members: The member modules of each block.
        names: The member FQNs of each block (for messages).

    Returns:
        Every module whose ``forward`` was overridden.

    Raises:
        RematError: If a module already belongs to another applied plan (nothing is installed then).
    """
    touched: list[nn.Module] = []
    try:
        for sub_op in _sub_ops(ops):
            # Wherever a RecomputeSub sits in the tree, its block's final run is the one that keeps
            # tensors; in the no-save runs above it the sub-module's own checkpoint is harmless.
            for fqn in sub_op.fqns:
                sub = model.get_submodule(fqn)
                _set_role(sub, _Role(_Span((Keep(0),), {0: [sub]}, 1), 0, sub.__dict__.get("forward"), fqn))
                touched.append(sub)
        for op in ops:
            if not isinstance(op, Recompute):
                continue
            covered = {k: list(members[k]) for k in range(op.start, op.stop)}
            flat = [(m, n) for k in range(op.start, op.stop) for m, n in zip(members[k], names[k])]
            span = _Span(op.inner, covered, len(flat))
            for pos, (module, name) in enumerate(flat):
                _set_role(module, _Role(span, pos, module.__dict__.get("forward"), name))
                touched.append(module)
    except BaseException:
        uninstall(touched)
        raise
    return touched


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


def is_dispatcher(module: nn.Module) -> bool:
    """Whether calls of ``module`` go to remat's dispatcher (they are then not real forward runs)."""
    return "_remat_role" in module.__dict__


@contextlib.contextmanager
def count_forwards(first_members: Sequence[nn.Module]) -> Iterator[dict[int, int]]:
    """Count how often each module's real forward runs (recomputations included).

    Yields:
        A dict from ``id(module)`` to the number of forward runs so far.
    """
    counts = {id(m): 0 for m in first_members}
    handles = [m.register_forward_pre_hook(lambda mod, _args: _count(mod, +1)) for m in first_members]
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
    """Report every real forward run remat's runner makes: ``observer(module, started, raised)``."""
    previous = _LOCAL.observer
    _LOCAL.observer = observer
    try:
        yield
    finally:
        _LOCAL.observer = previous
