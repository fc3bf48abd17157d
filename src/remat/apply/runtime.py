"""Executing plan operations on a live model through ``torch.utils.checkpoint``.

# NOTE [ Spans ]
A ``Recompute(a, b, inner)`` covers blocks ``a..b-1``, i.e. one or more member modules that the
user's own ``forward`` calls one after another. remat leaves the model's code alone and overrides the
instance ``forward`` of each member (parameters, state_dict keys and module identity are untouched):
the *first* member runs the whole span under one non-reentrant ``checkpoint`` and the *other* members
return their first argument, which must be the tensor the span just produced (checked by identity;
a model that does not call its blocks as a chain gets a ``RematError`` instead of wrong results).
Inside the span, the runner calls each kept member *directly* (``_LOCAL.direct``: the override passes
through to the original forward once) and each inner ``Recompute`` through a nested ``checkpoint``.
Members after the first receive the previous member's output as their first argument and the span's
other arguments unchanged (the ``for layer in layers: x = layer(x, mask)`` pattern).

# NOTE [ BatchNorm under recomputation ]
A recomputed forward runs BatchNorm in training mode again, so torch would update the running
statistics twice. Every recomputation (each call of a checkpointed function after the first) snapshots
the running statistics of the span's BatchNorm modules and restores them afterwards, also when torch
stops the recomputation early by raising.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from remat.errors import RematError
from remat.plan.chain import Keep, Op, Recompute, RecomputeSub

__all__ = ["install", "uninstall", "installed_modules", "count_forwards", "run_checkpointed"]

_CHECKPOINT_KWARGS = frozenset({"use_reentrant", "context_fn", "determinism_check", "debug", "preserve_rng_state"})


class _Local(threading.local):
    direct: nn.Module | None = None
    counts: dict[int, int] | None = None


_LOCAL = _Local()


@dataclass(eq=False)
class _Span:
    """One checkpointed region: its operations and the member modules of each block it covers."""

    ops: tuple[Op, ...]
    members: dict[int, list[nn.Module]]
    multi: bool
    last_output: Any = None  # weakref to the span's output, for the identity check of later members
    batchnorms: list[nn.Module] = field(default_factory=list)


@dataclass(eq=False)
class _Role:
    span: _Span
    position: int  # 0: runs the span; > 0: passes the span's output through
    previous_forward: Any  # an instance ``forward`` the module had before remat, or None
    name: str


def _original(module: nn.Module) -> Callable[..., Any]:
    prev = module.__dict__["_remat_role"].previous_forward
    return prev if prev is not None else type(module).forward.__get__(module)


def _call_direct(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Through __call__ so the module's own hooks run; the override sees `direct` and passes through.
    if "_remat_role" in module.__dict__:
        _LOCAL.direct = module
    try:
        return module(*args, **kwargs)
    finally:
        _LOCAL.direct = None


@contextlib.contextmanager
def _frozen_batchnorm(bns: Sequence[nn.Module]) -> Iterator[None]:
    # NOTE [ BatchNorm under recomputation ]
    saved = []
    for bn in bns:
        if bn.training and getattr(bn, "track_running_stats", False):
            buffers = [getattr(bn, name) for name in ("running_mean", "running_var", "num_batches_tracked")]
            saved.append([(buf, buf.detach().clone()) for buf in buffers if isinstance(buf, torch.Tensor)])
    try:
        yield
    finally:
        with torch.no_grad():
            for pairs in saved:
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
                out = _call_direct(module, args, kwargs)
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
        with _frozen_batchnorm(span.batchnorms):
            return _run_ops(ops, span, a, kw)

    return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _count(module: nn.Module, delta: int) -> None:
    counts = _LOCAL.counts
    if counts is not None and id(module) in counts:
        counts[id(module)] += delta


def _span_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    role: _Role = self.__dict__["_remat_role"]
    if _LOCAL.direct is self:
        _LOCAL.direct = None
        return _original(self)(*args, **kwargs)
    _count(self, -1)  # this call dispatches or passes through; the real forward is counted when it runs
    span = role.span
    if role.position > 0:
        expected = span.last_output() if span.last_output is not None else None
        if expected is not None and args and args[0] is expected:
            return args[0]
        raise RematError(
            f"apply: module {role.name!r} was called with something other than the output of the module before it, "
            "so this model does not call these blocks as a chain and they cannot share one checkpointed segment; "
            "use a plan whose segments hold one block each (e.g. strategy 'full' or solver 'knapsack')"
        )
    out = run_checkpointed(span.ops, span, args, kwargs)
    if span.multi:
        if not isinstance(out, torch.Tensor):
            raise RematError(
                f"apply: module {role.name!r} starts a segment of several modules but returns {type(out).__name__}; "
                "multi-module segments need modules that take and return one tensor"
            )
        span.last_output = weakref.ref(out)
    return out


def _set_role(module: nn.Module, role: _Role) -> None:
    if "_remat_role" in module.__dict__:
        raise RematError(
            f"apply: module {role.name!r} is already part of another checkpointed segment; blocks must not overlap"
        )
    module.__dict__["_remat_role"] = role
    module.__dict__["forward"] = types.MethodType(_span_forward, module)


def install(model: nn.Module, ops: tuple[Op, ...], members: Sequence[list[nn.Module]], names: Sequence[tuple[str, ...]]) -> list[nn.Module]:
    """Install the top-level operations ``ops`` on ``model``'s modules.

    Args:
        model: The model (used for sub-module lookup).
        ops: Top-level plan operations over blocks ``0..n-1``.
        members: The member modules of each block.
        names: The member FQNs of each block (for messages).

    Returns:
        Every module whose ``forward`` was overridden.
    """
    touched: list[nn.Module] = []
    for sub_op in _sub_ops(ops):
        # Wherever a RecomputeSub sits in the tree, its block's final run is the one that keeps
        # tensors; in the no-save runs above it the sub-module's own checkpoint is harmless.
        for fqn in sub_op.fqns:
            sub = model.get_submodule(fqn)
            span = _Span(ops=(Keep(0),), members={0: [sub]}, multi=False, batchnorms=_bns([sub]))
            _set_role(sub, _Role(span, 0, sub.__dict__.get("forward"), fqn))
            touched.append(sub)
    for op in ops:
        if not isinstance(op, Recompute):
            continue
        covered = {k: list(members[k]) for k in range(op.start, op.stop)}
        flat = [(m, n) for k in range(op.start, op.stop) for m, n in zip(members[k], names[k])]
        span = _Span(ops=op.inner, members=covered, multi=len(flat) > 1, batchnorms=_bns([m for m, _ in flat]))
        for pos, (module, name) in enumerate(flat):
            _set_role(module, _Role(span, pos, module.__dict__.get("forward"), name))
            touched.append(module)
    return touched


def _sub_ops(ops: tuple[Op, ...]) -> Iterator[RecomputeSub]:
    for op in ops:
        if isinstance(op, RecomputeSub):
            yield op
        elif isinstance(op, Recompute):
            yield from _sub_ops(op.inner)


def _bns(modules: Sequence[nn.Module]) -> list[nn.Module]:
    return [m for top in modules for m in top.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


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


def installed_modules(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model`` that currently carries a remat override."""
    return [m for m in model.modules() if "_remat_role" in m.__dict__]


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
