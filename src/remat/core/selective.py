"""Op-level selective recompute: run a block under one checkpoint that caches the outputs of chosen ops.

# NOTE [ Op keys ]
An op of a block is named by ``"<name>#<occurrence>"``: its short aten name (``gelu``, ``addmm``,
``native_layer_norm``; ``"<namespace>::<name>"`` outside aten) and how many ops of that name the block
ran before it in the same forward, e.g. ``"gelu#0"``, ``"addmm#2"``. The same :class:`OpKeys` counter
names the ops in the profile (``remat.profile.ops``) and in the policy that :func:`run_selective`
gives torch, with fresh counts per block forward, so a key means the same op in every run as long as
the block's forward runs the same ops (it must for recomputation anyway). Ops that torch's selective
checkpoint never asks about (``SAC_IGNORED_OPS``: the ``detach`` calls checkpointing itself inserts)
get no key and are not counted.

# NOTE [ Selective recompute semantics ]
Under a non-reentrant checkpoint with a selective policy (``torch.utils.checkpoint``,
``create_selective_checkpoint_contexts``), the forward keeps nothing of what autograd saves inside
the region; it caches the outputs of the ops marked ``MUST_SAVE`` (detached, with their version
counters) and the region's inputs (the checkpoint's closure). In the backward the region's forward
runs again under the saved RNG state: a cached op returns its cached outputs, every other op runs
again, until the last tensor the forward saved is saved again (torch's early stop). Hence:

- held between forward and backward: the unique storages of the cached ops' outputs (a cached view
  holds its whole base);
- recompute time: the ops before the early stop that are not cached;
- an op whose output a later op of the region mutates in place cannot be cached (torch refuses the
  mutated cache entry), and caching an in-place op is wrong (its caller may ignore the return value
  and read the recomputed tensor it was meant to mutate);
- a cached random op does not draw from the generator in the recompute, so every random op after it
  must be cached too, or it would draw different numbers than in the forward.

# NOTE [ Op-level policies ]
A plan keeps a block under an op-level policy with ``RecomputeOps(index, save, recompute)``
(``remat.core.ops``): the runtime (``remat.core.runtime``) calls the block's own forward through
:func:`run_selective` with ``save`` as the cached ops. Rules that keep it exact:

- top level only: ``validate_ops`` refuses a policy inside a recomputed segment (the segment's replay
  would run torch's checkpoint inside remat's recording), and the solvers never place one there;
- single-module blocks only: op keys count per forward of one module (``apply`` refuses a group);
- no state: the profile offers no policy for a block whose ops write into storages they did not
  allocate (a BatchNorm's running statistics, an in-place edit of an input), whose recomputation
  would write them twice, nor for a stateful block;
- which ops may be cached (no views, no in-place ops, nothing a later op mutates, random ops in
  order): ``remat.plan.policies.validate_policy``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from remat.core.tree import flatten, unflatten
from remat.core.versions import Saved, note_saved
from remat.errors import RematError

__all__ = ["IGNORED_OPS", "OpKeys", "op_name", "ops_in_words", "run_selective", "saves_recorded"]

log = logging.getLogger(__name__)

_LOCAL = threading.local()


def _metadata(x: torch.Tensor) -> dict[str, Any]:
    """torch's default determinism metadata of a saved tensor; inside :func:`saves_recorded`, also notes
    the tensor (weakly) with its version (NOTE [ Saved tensors edited before the backward ] in
    ``remat.core.versions``: torch's checkpoint calls this for every tensor it drops in the forward)."""
    saved = getattr(_LOCAL, "saved", None)
    if saved is not None:
        saved.append(note_saved(x))
    return {"shape": x.shape, "dtype": x.dtype, "device": x.device}


# torch's checkpoint takes its metadata function by name from this table (since torch 2.1); without it
# the default check runs and nothing is noted.
_CHECKS: dict[str, Any] | None = getattr(torch.utils.checkpoint, "_allowed_determinism_checks_to_fns", None)
if _CHECKS is not None:
    _CHECKS["remat"] = _metadata
_DETERMINISM = "remat" if _CHECKS is not None else "default"


@contextlib.contextmanager
def saves_recorded(saved: list[Saved]) -> Iterator[None]:
    """Note in ``saved`` every tensor that a :func:`run_selective` region started inside drops in its forward."""
    previous = getattr(_LOCAL, "saved", None)
    _LOCAL.saved = saved
    try:
        yield
    finally:
        _LOCAL.saved = previous


IGNORED_OPS: frozenset[Any] = frozenset(
    getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", None) or {torch.ops.aten.detach.default}
)
"""Ops torch's selective checkpoint passes through without asking the policy: they get no key."""


def stop_passing(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for ``torch.utils.checkpoint``, whose early stop raises ``_StopRecomputationError`` (an
    ``Exception``) from its pack hook: where the model's code wrapped it in an error of its own (einx's
    ``CallOperationError ... from e``), raise torch's signal again so that its recompute stops as meant."""
    stop_type = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)
    if stop_type is None or torch.compiler.is_compiling():
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        stop: BaseException | None = None
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            seen: set[int] = set()
            cur: BaseException | None = e.__cause__ or e.__context__
            while cur is not None and id(cur) not in seen:
                if isinstance(cur, stop_type):
                    stop = cur
                    break
                seen.add(id(cur))
                cur = cur.__cause__ or cur.__context__
            if stop is None:
                raise
            # Drop the wrapper and the tracebacks: they hold the replay's frames, and a raise inside this
            # handler would link the signal and the wrapper into a cycle that keeps those tensors alive
            # until the garbage collector runs (measured 1.16x a plan's budget).
            e.__cause__ = e.__context__ = None
            e.__traceback__ = None
        stop.__cause__ = stop.__context__ = None
        raise stop.with_traceback(None)

    return call


@functools.cache  # ops are few and live as long as the process; the policy asks per call
def op_name(func: Any) -> str:
    """The short name of an op overload: ``aten.gelu.default`` -> ``"gelu"``, ``mylib.foo.default`` -> ``"mylib::foo"``."""
    packet = getattr(func, "_overloadpacket", None)
    name = str(getattr(packet, "__name__", None) or getattr(func, "__name__", func)).split(".")[0]
    namespace = getattr(func, "namespace", "aten")
    return name if namespace == "aten" else f"{namespace}::{name}"


def ops_in_words(keys: Sequence[str]) -> str:
    """Op keys counted by the name a user knows the op by, in order of first appearance:
    ``["native_layer_norm#0", "gelu#0", "native_layer_norm#1"]`` -> ``"layer_norm×2, gelu×1"``
    (aten's ``native_`` prefix and underscores dropped)."""
    counts: dict[str, int] = {}
    for key in keys:
        name = key.rsplit("#", 1)[0]
        shown = name.removeprefix("native_").strip("_") or name
        counts[shown] = counts.get(shown, 0) + 1
    return ", ".join(f"{name}×{n}" for name, n in counts.items())


class OpKeys:
    """Names the ops of one block forward in call order (NOTE [ Op keys ]); one instance per forward."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def __call__(self, func: Any) -> str | None:
        """The key of the next call of ``func``, or ``None`` for an op in :data:`IGNORED_OPS`."""
        if func in IGNORED_OPS:
            return None
        name = op_name(func)
        k = self._seen.get(name, 0)
        self._seen[name] = k + 1
        return f"{name}#{k}"

    def __bool__(self) -> bool:
        return bool(self._seen)

    def ran(self, key: str) -> bool:
        """Whether the op ``key`` has been named (ran) in this forward."""
        name, _, k = key.rpartition("#")
        return k.isdigit() and self._seen.get(name, 0) > int(k)


def _contexts(save: frozenset[str], keys: dict[bool, OpKeys], casts: list[Any]) -> tuple[Any, Any]:
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        recompute = bool(getattr(ctx, "is_recompute", False))
        if not recompute and func is torch.ops.aten._to_copy.default and _cast_leaf(args):
            out = getattr(ctx, "op_output", None)
            if isinstance(out, torch.Tensor):  # NOTE [ Autocast's cache in a policy's recomputation ]
                casts.append(weakref.ref(out))
        key = keys[recompute](func)
        if key in save and not _inference(getattr(ctx, "op_output", None)):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)  # type: ignore[no-any-return]


# NOTE [ Ops run under inference mode ]
# A block may compute a constant under ``torch.inference_mode()`` (a normaliser's statistics, then
# ``.clone()``d out of it). torch's selective checkpoint stores a cached op's output with its version,
# which an inference tensor does not track: a policy that cached such an op (the planner's menu lists
# every fresh op, and autograd saves nothing of it, so caching it looked free) crashed in the forward
# with torch's "Inference tensors do not track version counter" (helper-119). Such an op is recomputed
# instead, which gives the same values (it reads only what its forward read) and holds less.
def _inference(out: Any) -> bool:
    """Whether ``out`` (an op's output, possibly a tuple or list) holds an inference tensor."""
    if isinstance(out, torch.Tensor):
        return out.is_inference()
    if isinstance(out, (tuple, list)):
        return any(_inference(o) for o in out)
    return torch.is_inference_mode_enabled()


def _cast_leaf(args: Sequence[Any]) -> bool:
    t = args[0] if args else None
    return isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad and torch.is_autocast_cache_enabled()


# NOTE [ Autocast's cache in a policy's recomputation ]
# torch's selective checkpoint matches the recomputation's ops to the forward's by their order, per op.
# Under an autocast whose cache is enabled, a forward that casts a leaf that requires grad (a parameter,
# an input) caches the cast; a recomputation that runs while the cache still holds it (the backward
# inside the same autocast region: each step's own ``with autocast():`` around forward and backward)
# finds it there and runs no ``_to_copy`` for it, so every later ``_to_copy`` of the block is matched to
# the wrong entry of the forward: torch refuses where the ops differ ("... not found in storage"), and
# where a cached cast and a later cast have the same shape, the recomputation read the wrong tensor
# (gradients 0.06 off, silently; helper-53). Turning the cache off for the block changes the plain
# model's values (autocast reuses the cast of a parameter made before an optimizer step until its region
# exits). So the planner never caches a ``_to_copy`` (``remat.plan.policies._cacheable``: a cast is
# cheap to run again), and a policy that caches one (written by hand) is refused before its
# recomputation runs where a cast of a leaf its forward made is still alive in the backward (held by
# the cache). A policy that caches no cast recomputes every cast it runs whatever its index, and the
# values it recomputes are the forward's.


def run_selective(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    save: frozenset[str],
    name: str | None = None,
) -> Any:
    """Call ``fn(*args, **kwargs)`` under one non-reentrant checkpoint that caches the outputs of the ops in ``save``.

    Every other op of the call is recomputed in the backward (NOTE [ Selective recompute semantics ]);
    an empty ``save`` is plain checkpointing. The RNG state is preserved, so dropout draws the same
    masks in the recompute. Logs a warning when an op of ``save`` does not run in the forward (the
    policy does not fit the call: those ops are then recomputed).

    Args:
        fn: The block's forward (a module or a function).
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        save: Keys of the ops whose outputs are cached (NOTE [ Op keys ]), e.g. ``{"addmm#0", "bmm#1"}``.
        name: What to call the block in errors, e.g. ``"module 'layers.3'"``.

    Returns:
        What ``fn`` returns.

    Raises:
        RematError: In the backward, where ``save`` holds a cast that autograd's autocast cache makes the
            recomputation skip (NOTE [ Autocast's cache in a policy's recomputation ]).
    """
    # The arguments go in flattened (remat.core.tree, as remat's own recording does): torch's
    # recomputation calls ``fn`` again on what it was given, and a container the block or the model
    # changed since (a state dict the block writes its new state into) would give it other inputs;
    # rebuilt from the leaves, it sees the forward's. The forward itself gets the caller's containers: a
    # block that writes into a dict it is given (a state dict a later block reads) wrote into a copy,
    # and the later block found nothing (a raw KeyError, or its default, silently). Keywords never reach
    # checkpoint(), whose own (``context_fn``, ``debug`` ...) a block's keyword might shadow.
    leaves, spec = flatten((tuple(args), dict(kwargs)))
    runs = [0]
    casts: list[
        Any
    ] = []  # weakly, the forward's casts of leaves (NOTE [ Autocast's cache in a policy's recomputation ])
    caches_casts = any(key.rpartition("#")[0] == "_to_copy" for key in save)

    def call(*flat: Any) -> Any:
        runs[0] += 1
        if runs[0] == 1:
            return fn(*args, **kwargs)
        if caches_casts and any(ref() is not None for ref in casts):
            raise RematError(
                f"apply: {name or 'a block'} runs under an op-level policy (RecomputeOps) that caches a cast "
                "(_to_copy), and its backward runs inside the autocast region of its forward, whose cache still "
                "holds the casts of parameters its forward made: the recomputation would not make them again, and "
                "torch's selective checkpoint, which matches its ops to the forward's by their order, would read "
                "the wrong cached tensor; call backward() outside the autocast region (as torch recommends), use "
                "torch.autocast(..., cache_enabled=False), or recompute that cast (remat.plan never caches one)"
            )
        a, k = unflatten(list(flat), spec)
        return fn(*a, **k)

    # Fresh counters per call. torch 2.13 asks the policy in the forward only (the recompute reads its
    # cache by index); older versions asked again in the recompute, with ``ctx.is_recompute`` set,
    # which then counts on its own from zero.
    keys = {False: OpKeys(), True: OpKeys()}
    save = frozenset(save)
    out = checkpoint(
        stop_passing(call),
        *leaves,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=functools.partial(_contexts, save, keys, casts),
        determinism_check=_DETERMINISM,
    )
    forward = keys[False]
    if forward:  # the policy ran (it does not without grad)
        missing = sorted(k for k in save if not forward.ran(k))
        if missing:
            log.warning(
                "run_selective: cached ops %s did not run in this forward of %s, so they are recomputed; the "
                "policy was made for another block or its forward changed (train/eval mode, shapes); profile "
                "it again with remat.profile.ops.profile_ops",
                ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else ""),
                getattr(fn, "__qualname__", type(fn).__name__),
            )
    return out
