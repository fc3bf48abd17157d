"""Running one iteration of the user's training loop and recording every allocation and free it makes.

# NOTE [ What a step's peak means ]
A budget, a profile's peak and a measurement's peak are one figure: the peak of *one iteration of
the user's training loop* above the memory held when it starts. The loop is described by
:class:`Loop` (``grads=`` and ``optimizer=`` of ``remat.profile`` / ``measure`` / ``timeline``):

  * ``grads="none"`` (the default, PyTorch's: ``optimizer.zero_grad()`` sets gradients to ``None``):
    the iteration starts with no parameter gradients; each is allocated in the backward, when the
    module that owns it runs its backward, and stays to the end of the iteration. Held before it:
    parameters, buffers, inputs and the optimizer state.
  * ``grads="held"`` (``zero_grad(set_to_none=False)``, remat's only definition before loops existed):
    gradients are allocated before the iteration and zeroed in place; they are held too.
  * ``optimizer``: the iteration ends with ``optimizer.step()``; its own temporaries (Adam's update
    of each parameter, the lists of foreach kernels) are part of the peak. Its state (AdamW's
    ``exp_avg`` and ``exp_avg_sq``) is created by the first step and held before every later one, so
    it counts as held: remat runs warm-up iterations first, and the figure is that of every
    iteration but the very first of a run (which also allocates the state, twice the parameters for
    Adam). Without an optimizer the iteration ends with the backward.

So "peak 40 MiB" with ``grads="none"`` and AdamW reads: the peak of forward + backward + AdamW step,
gradients allocated in the backward, above parameters, buffers, inputs and optimizer state
(:meth:`Loop.describe`); add the held memory for what ``torch.cuda.max_memory_allocated`` reports.
What the iteration adds — activations saved for backward, temporaries, gradients of activations,
parameter gradients with ``grads="none"``, the optimizer's temporaries — is what a plan must fit;
only the activations are what checkpointing changes. Measuring leaves the model as it was: the
optimizer steps change parameters and optimizer state, which :func:`iteration` puts back.

On CPU the figure is exact: the torch profiler records every allocation and free of the step
(``profile_memory=True``) and remat cumulates their signed sizes in time order. On CUDA the same
events are read for the timeline and the allocator's ``max_memory_allocated`` gives the peak.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import inspect
import os
import random
import statistics
import sys
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, record_function
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from remat.errors import RematError

__all__ = [
    "Grads",
    "Loop",
    "OptimizerLike",
    "Iteration",
    "iteration",
    "parse_grads",
    "MemoryTrace",
    "call_model",
    "call_loss",
    "check_loss_fn",
    "train_step",
    "preserved",
    "record_memory",
    "mark",
    "held_bytes",
    "device_of",
    "timed_steps",
    "allocation_lifetimes",
]

MARK_PREFIX = "remat::"


def device_of(model: nn.Module, inputs: Any) -> torch.device:
    """The device the step runs on: the first parameter's, else the first input tensor's."""
    for p in model.parameters():
        return p.device
    for leaf in tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def is_tensordict(obj: Any) -> bool:
    """Whether ``obj`` is a ``tensordict.TensorDictBase`` (checked without importing tensordict): a mapping
    that is one argument of its model (``TensorDictModule(td)``), never its keyword arguments."""
    return any(c.__name__ == "TensorDictBase" and c.__module__.startswith("tensordict") for c in type(obj).__mro__)


def call_model(model: nn.Module, inputs: Any, where: str = "step") -> Any:
    """Call ``model`` on ``inputs``: a tensor (``model(x)``), a tuple/list (``model(*x)``) or a dict, or any
    mapping such as HF's ``BatchEncoding`` (``model(**x)``); a TensorDict is one argument (``model(td)``).

    Each call gets its own copy of the containers (pytree's: tuples, lists, dicts, TensorDicts), holding
    the same tensors: remat runs the one batch many times, and a model that writes into the containers it
    is given (a ``TensorDictModule`` sets its ``out_keys`` in its input) would otherwise read the previous
    iteration's outputs, graph and all, where the user's loop gives every iteration a fresh batch.

    Raises:
        RematError: If the model's forward fails while a tensor of the batch is on another device, or of
            another floating dtype, than every parameter (:func:`_batch_mismatch`), chained to the
            model's own error. Any other failure of the forward propagates as it is.
    """
    flat, spec = tree_flatten(inputs)
    copied = tree_unflatten(flat, spec)
    try:
        if is_tensordict(copied):
            return model(copied)
        if isinstance(copied, Mapping):
            return model(**copied)
        if isinstance(copied, (tuple, list)):
            return model(*copied)
        return model(copied)
    except RematError:
        raise
    except Exception as e:
        # NOTE [ A batch on another device or dtype ]: the check runs only once the forward has failed,
        # so a model that moves or casts its batch itself (or runs under autocast) is never refused;
        # where it did fail and the batch does not match the parameters, that mismatch is the likely
        # cause and the message says how to fix it, with torch's own error chained below.
        mismatch = _batch_mismatch(model, inputs)
        if mismatch is None:
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        raise RematError(
            f"{where}: the model's forward failed on the batch ({type(e).__name__}: {first}); {mismatch}"
        ) from e


def _batch_mismatch(model: nn.Module, inputs: Any) -> str | None:
    """Words for the first tensor of ``inputs`` on a device no parameter is on, or of a floating dtype no
    floating parameter has (integer tensors, token ids, are never a mismatch), with the fix; ``None`` if
    there is none (or the model has no parameters)."""
    params = list(model.parameters())
    if not params:
        return None
    devices = {p.device for p in params}
    dtypes = {p.dtype for p in params if p.is_floating_point()}
    try:
        from torch.utils._pytree import keystr, tree_flatten_with_path

        leaves = [(f"inputs{keystr(path)}", leaf) for path, leaf in tree_flatten_with_path(inputs)[0]]
    except (ImportError, TypeError, ValueError):  # a container pytree cannot name its paths in
        leaves = [("inputs", leaf) for leaf in tree_leaves(inputs)]
    want_device = str(params[0].device)
    for name, leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.device not in devices:
            return (
                f"{name} is on {leaf.device} but the model's parameters are on {want_device}; move the batch to the "
                f"model's device (x.to({want_device!r})) or the model to the batch's (model.to({str(leaf.device)!r}))"
            )
    for name, leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and dtypes and leaf.dtype not in dtypes:
            want = str(next(p.dtype for p in params if p.is_floating_point()))
            return (
                f"{name} is {leaf.dtype} but the model's parameters are {', '.join(sorted(map(str, dtypes)))}; cast "
                f"the batch (x.to({want})) or the model (model.to({leaf.dtype}))"
            )
    return None


def call_loss(loss_fn: Callable[[Any], torch.Tensor], output: Any, where: str) -> torch.Tensor:
    """``loss_fn(output)``, checked: a scalar tensor that requires grad.

    Args:
        loss_fn: The user's loss function, called with the model's output only.
        output: The model's output.
        where: The public verb that called it, the start of every message (``"profile"``, ``"measure"``).

    Raises:
        RematError: If ``loss_fn`` cannot be called with one argument (``F.cross_entropy``, which also
            wants the targets), or does not return a scalar tensor that requires grad. A TypeError raised
            inside a loss that does take one argument is the user's own, and propagates as it is.
    """
    check_loss_fn(loss_fn, where)
    try:
        loss = loss_fn(output)
    except TypeError:
        if _takes_one_argument(loss_fn, output):
            raise
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        raise RematError(
            f"{where}: loss_fn {name} cannot be called with the model's output alone; loss_fn is called with the "
            "model's output only, so close over your targets: lambda out: F.cross_entropy(out, y)"
        ) from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise RematError(
            f"{where}: loss_fn returned {what}{'' if not isinstance(loss, torch.Tensor) or loss.requires_grad else ' without grad'}; "
            "it must map the model's output to a scalar loss that depends on the parameters, e.g. "
            "lambda out: F.cross_entropy(out, y)"
        )
    return loss


def check_loss_fn(loss_fn: Any, where: str) -> None:
    """A RematError naming ``loss_fn`` unless it can be called (``None``, or the loss tensor itself,
    passed where the function that makes it belongs)."""
    if not callable(loss_fn):
        what = f"a tensor of shape {tuple(loss_fn.shape)}" if isinstance(loss_fn, torch.Tensor) else repr(loss_fn)[:80]
        raise RematError(
            f"{where}: loss_fn is {what}, not a function; pass one that maps the model's output to a scalar "
            "loss, e.g. lambda out: F.cross_entropy(out, y)"
        )


def _takes_one_argument(fn: Callable[..., Any], arg: Any) -> bool:
    """Whether ``fn``'s signature accepts ``fn(arg)`` (True where it has none Python can read)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(arg)
    except TypeError:
        return False
    return True


def train_step(
    model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor], *, where: str = "step"
) -> torch.Tensor:
    """One forward and backward pass; returns the (detached) loss.

    Args:
        model: The model.
        inputs: A tensor, a tuple of positional arguments or a dict of keyword arguments.
        loss_fn: Maps the model's output to a scalar loss.
        where: The public verb that runs the step, the start of every message (``"measure"`` ...).

    Raises:
        RematError: If gradients are disabled or ``loss_fn`` does not return a scalar tensor that
            requires grad (:func:`call_loss`).
    """
    if not torch.is_grad_enabled():
        raise RematError(
            f"{where}: gradients are disabled (torch.no_grad() or inference_mode); remat measures training steps, call it with grad enabled"
        )
    out = call_model(model, inputs, where)
    loss = call_loss(loss_fn, out, where)
    loss.backward()
    return loss.detach()


@contextlib.contextmanager
def preserved(model: nn.Module, inputs: Any = None) -> Iterator[None]:
    """Run steps inside, then put the model back exactly: gradients, buffers, RNG state (the default
    generators, generators the model's modules hold as attributes, Python's and numpy's global ones),
    train/eval mode and the plain attributes of its modules (a call counter).

    Parameters are not touched by a step (no optimizer runs); input tensors' ``.grad`` are restored too.
    """
    params = list(model.parameters())
    # Gradients go back into the very tensors they were in (something may hold them, e.g. buckets).
    grads = [(p.grad, None if p.grad is None else p.grad.detach().clone()) for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    in_tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    in_grads = [(t.grad, None if t.grad is None else t.grad.detach().clone()) for t in in_tensors]
    modes = [(m, m.training) for m in model.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    own = {
        id(g): (g, g.get_state()) for m in model.modules() for g in vars(m).values() if isinstance(g, torch.Generator)
    }
    plain = [
        (m, name, value)
        for m in model.modules()
        for name, value in vars(m).items()
        if name != "training" and isinstance(value, (int, float, str, bytes, complex, type(None)))
    ]
    np = sys.modules.get("numpy")
    py_rng = random.getstate(), np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        with torch.no_grad():
            for p, (orig, copy) in zip(params, grads):
                if orig is not None and copy is not None:
                    orig.copy_(copy)
                p.grad = orig
            for b, copy in buffers:
                b.copy_(copy)
            for t, (orig, copy) in zip(in_tensors, in_grads):
                if t.is_leaf:
                    if orig is not None and copy is not None:
                        orig.copy_(copy)
                    t.grad = orig
        for m, training in modes:
            m.training = training
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for g, state in own.values():
            g.set_state(state)
        for m, name, value in plain:
            m.__dict__[name] = value
        random.setstate(py_rng[0])
        if np is not None:
            np.random.set_state(py_rng[1])


def held_bytes(model: nn.Module, inputs: Any, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Memory held before a step: on CUDA the allocator's figure, on CPU the unique storages of
    parameters, gradients, buffers, inputs and the optimizer's state."""
    dev = device_of(model, inputs)
    if dev.type == "cuda":
        return int(torch.cuda.memory_allocated(dev))
    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    if optimizer is not None:
        tensors += [
            t
            for state in optimizer.state.values()
            for t in tree_leaves(state)
            if isinstance(t, torch.Tensor) and t.device == dev
        ]
    for t in tensors:
        try:
            st = t.untyped_storage()
            # A DTensor (FSDP2's sharded parameters) or a freed storage has no data pointer: skip it.
            seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            continue
    return sum(seen.values())


def mark(name: str) -> None:
    """Leave a zero-length ``remat::<name>`` marker in the running profiler's trace."""
    with record_function(MARK_PREFIX + name):
        pass


@dataclass(frozen=True)
class MemoryTrace:
    """Memory over one step: the level after every allocation or free, and the markers.

    Attributes:
        t_ns: Event times, nanoseconds from the start of the step.
        level_bytes: Bytes allocated above the level before the step, after each event.
        marks: ``(name, t_ns)`` of each marker, in time order.
        peak_bytes: The highest level, bytes (0 if the step never rose above its start).
        duration_ns: Length of the step, nanoseconds.
        device: ``"cpu"`` or ``"cuda"``.
        ptrs: Address of the block each event allocated (positive ``deltas``) or freed (empty for a
            trace made without them).
        deltas: Bytes each event allocated (negative: freed).
    """

    t_ns: tuple[int, ...]
    level_bytes: tuple[int, ...]
    marks: tuple[tuple[str, int], ...]
    peak_bytes: int
    duration_ns: int
    device: str
    ptrs: tuple[int, ...] = ()
    deltas: tuple[int, ...] = ()

    def lifetimes(self) -> dict[int, list[tuple[int, int]]]:
        """Address -> ``(allocated, freed)`` times of every block the step allocated there, in order (freed:
        ``duration_ns`` if the step did not free it). An address names a block only with a time: the
        allocator hands a freed block's address to a later allocation."""
        out: dict[int, list[tuple[int, int]]] = {}
        born: dict[int, int] = {}
        for when, ptr, delta in zip(self.t_ns, self.ptrs, self.deltas):
            if delta > 0:
                born[ptr] = when
            elif ptr in born:
                out.setdefault(ptr, []).append((born.pop(ptr), when))
        for ptr, when in born.items():
            out.setdefault(ptr, []).append((when, self.duration_ns))
        return out

    def level_at(self, t: int) -> int:
        """Level at time ``t`` (after every event at or before it), bytes."""
        i = bisect_right(self.t_ns, t)
        return self.level_bytes[i - 1] if i else 0

    def peak_between(self, t0: int, t1: int) -> int:
        """Highest level reached in ``[t0, t1]`` (the level at ``t0`` included), bytes."""
        lo, hi = bisect_right(self.t_ns, t0), bisect_right(self.t_ns, t1)
        return max([self.level_at(t0), *self.level_bytes[lo:hi]])

    def mark_times(self) -> dict[str, list[int]]:
        """Times of every marker by name (several if a marker fired more than once)."""
        out: dict[str, list[int]] = {}
        for name, t in self.marks:
            out.setdefault(name, []).append(t)
        return out


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    # torch's profiler backend (kineto) prints "profiler_start" / "profiler_stop" lines on the
    # process's stderr at every start and stop, whatever its log level; silence just those calls.
    try:
        sys.stderr.flush()
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:  # no file descriptor 2 (embedded interpreters): nothing to silence
        yield
        return
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@dataclass(frozen=True)
class _Events:
    """Raw profiler events of one step: allocations ``(t_ns, ptr, bytes)`` (negative bytes: frees)
    and markers ``(name, t_ns)``, times from the step's start."""

    allocs: list[tuple[int, int, int]]
    marks: list[tuple[str, int]]
    duration_ns: int


def _profiled(step: Callable[[], Any], device: torch.device) -> _Events:
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=False)
    with _quiet_native_stderr():
        prof.start()
    try:
        mark("step_start")
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        mark("step_end")
    finally:
        with _quiet_native_stderr():
            prof.stop()
    tree = prof.profiler.kineto_results.experimental_event_tree()  # type: ignore[union-attr]
    allocs: list[tuple[int, int, int]] = []
    marks: list[tuple[str, int]] = []
    from torch._C._profiler import _EventType

    stack = list(tree)
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            ef = node.extra_fields
            if ef.device.type == device.type:
                allocs.append((node.start_time_ns, int(ef.ptr), int(ef.alloc_size)))
        elif node.name.startswith(MARK_PREFIX):
            marks.append((node.name[len(MARK_PREFIX) :], node.start_time_ns))
        stack.extend(node.children)
    marks.sort(key=lambda m: m[1])
    times = dict(marks)
    if "step_start" not in times or "step_end" not in times:
        raise RematError("measure: the profiler lost remat's step markers; run with no other profiler active")
    t0 = times["step_start"]
    allocs.sort()
    # Only frees of blocks the step itself allocated. The CPU allocator sizes a free from a table that
    # it fills only while a memory profiler runs and never cleans outside one: a block allocated in an
    # earlier profiled session (freed now by the garbage collector), or a block now at an address such
    # a block once had (sized from that stale record), would show as a free of memory held before the
    # step and drop the level below its start; the allocator drops every other such free already.
    live: set[int] = set()
    ours = []
    for t, ptr, size in allocs:
        if size > 0:
            live.add(ptr)
        elif ptr in live:
            live.discard(ptr)
        else:
            continue
        ours.append((t, ptr, size))
    return _Events(
        allocs=[(t - t0, ptr, size) for t, ptr, size in ours],
        marks=[(n, t - t0) for n, t in marks if n not in ("step_start", "step_end")],
        duration_ns=times["step_end"] - t0,
    )


def record_memory(step: Callable[[], Any], device: torch.device) -> MemoryTrace:
    """Run ``step`` once under the torch profiler and return its allocation trace.

    See NOTE [ What a step's peak means ].
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start_alloc = torch.cuda.memory_allocated(device)
    events = _profiled(step, device)
    level, peak = 0, 0
    t_ns, levels, ptrs, deltas = [], [], [], []
    for t, ptr, delta in events.allocs:
        level += delta
        peak = max(peak, level)
        t_ns.append(t)
        levels.append(level)
        ptrs.append(ptr)
        deltas.append(delta)
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device)) - int(start_alloc)
    return MemoryTrace(
        t_ns=tuple(t_ns),
        level_bytes=tuple(levels),
        marks=tuple(events.marks),
        peak_bytes=peak,
        duration_ns=events.duration_ns,
        device=device.type,
        ptrs=tuple(ptrs),
        deltas=tuple(deltas),
    )


def allocation_lifetimes(
    step: Callable[[], Any], device: torch.device
) -> tuple[list[tuple[int, int, int, int | None]], dict[str, int]]:
    """Run ``step`` under the torch profiler; every allocation it made and when it was freed.

    Returns:
        ``(ptr, bytes, allocation time, free time or None)`` per block of memory allocated during the
        step (times in ns; ``None``: still alive at the step's end), and the time of every marker (its
        first occurrence), ns.
    """
    events = _profiled(step, device)
    times: dict[str, int] = {}
    for name, t in events.marks:
        times.setdefault(name, t)
    out: list[tuple[int, int, int, int | None]] = []
    open_: dict[int, int] = {}
    for t, ptr, size in events.allocs:
        if size > 0:
            open_[ptr] = len(out)
            out.append((ptr, size, t, None))
        elif ptr in open_:
            j = open_.pop(ptr)
            out[j] = (*out[j][:3], t)
    return out, times


def timed_steps(step: Callable[[], Any], device: torch.device, repeats: int) -> list[float]:
    """Wall time of ``repeats`` calls of ``step``, milliseconds each (CUDA: synchronised)."""
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append((time.perf_counter() - t) * 1000)
    return out


def median(values: list[float]) -> float:
    """Median of a non-empty list (0.0 for an empty one)."""
    return statistics.median(values) if values else 0.0


def zero_grads(model: nn.Module) -> None:
    """Zero existing parameter gradients in place (kept allocated; see NOTE [ What a step's peak means ])."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.detach_()
            p.grad.zero_()


class Grads(str, enum.Enum):
    """Where parameter gradients are when an iteration of the training loop starts (NOTE [ What a step's peak means ]).

    Attributes:
        NONE: Set to ``None`` (``optimizer.zero_grad()``, PyTorch's default): allocated in the backward.
        HELD: Allocated and zeroed in place (``zero_grad(set_to_none=False)``): held before the iteration.
    """

    NONE = "none"
    HELD = "held"


OptimizerLike = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""An optimizer whose ``step()`` ends each iteration, or a factory that builds one from the parameters
(``torch.optim.AdamW``, ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``)."""


@dataclass(frozen=True)
class Loop:
    """Which iteration a peak is the peak of: how gradients start, and which optimizer steps after the backward.

    Attributes:
        grads: :attr:`Grads.NONE` (gradients allocated in the backward) or :attr:`Grads.HELD`.
        optimizer: Class name of the optimizer whose ``step()`` ends the iteration (``None``: no step).
    """

    grads: Grads = Grads.NONE
    optimizer: str | None = None

    def describe(self) -> str:
        """The definition in words, e.g. "peak of forward + backward + AdamW step, gradients allocated in
        the backward, above parameters, buffers, inputs and optimizer state"."""
        step = "forward + backward" + (f" + {self.optimizer} step" if self.optimizer else "")
        held = ["parameters", *(["gradients"] if self.grads is Grads.HELD else []), "buffers", "inputs"]
        if self.optimizer:
            held.append("optimizer state")
        grads = "gradients allocated in the backward" if self.grads is Grads.NONE else "gradients held, zeroed in place"
        return f"peak of {step}, {grads}, above {', '.join(held[:-1])} and {held[-1]}"


def parse_grads(grads: Grads | str, where: str) -> Grads:
    """``grads`` as a :class:`Grads`.

    Raises:
        RematError: If it names no loop style; the message lists the valid ones.
    """
    if isinstance(grads, Grads):
        return grads
    try:
        return Grads(grads)
    except ValueError:
        valid = ", ".join(repr(g.value) for g in Grads)
        raise RematError(
            f"{where}: grads={grads!r} is not a loop style; valid styles are {valid} ('none': gradients set to "
            "None before each iteration, PyTorch's default; 'held': zeroed in place)"
        ) from None


class Iteration:
    """One iteration of the user's training loop on a model (NOTE [ What a step's peak means ]).

    Built by :func:`iteration`, which puts everything it changes back. :meth:`reset` is what the loop
    does between iterations (outside every measurement); :meth:`step` is the iteration itself.

    Attributes:
        model: The model.
        inputs: Its batch.
        loss_fn: Maps the model's output to a scalar loss.
        loop: The loop it runs.
        optimizer: The optimizer whose ``step()`` ends the iteration, or ``None``.
        where: The public verb measuring it, the start of its messages (``"profile"``, ``"measure"`` ...).
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Any,
        loss_fn: Callable[[Any], torch.Tensor],
        loop: Loop,
        optimizer: torch.optim.Optimizer | None,
        where: str = "measure",
    ) -> None:
        self.model = model
        self.inputs = inputs
        self.loss_fn = loss_fn
        self.loop = loop
        self.optimizer = optimizer
        self.where = where

    def reset(self) -> None:
        """Between iterations: gradients to ``None``, or zeroed in place (allocated if missing)."""
        if self.loop.grads is Grads.NONE:
            for p in self.model.parameters():
                p.grad = None
        else:
            zero_grads(self.model)

    def step(self, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> torch.Tensor:
        """Forward, backward and the optimizer's step; returns the detached loss."""
        loss = train_step(self.model, self.inputs, loss_fn or self.loss_fn, where=self.where)
        self.optimizer_step()
        return loss

    def optimizer_step(self) -> None:
        """The optimizer's step, if the loop has one, between the markers ``optimizer_start`` and ``optimizer_end``."""
        if self.optimizer is not None:
            mark("optimizer_start")
            self.optimizer.step()
            mark("optimizer_end")

    def run(self) -> None:
        """A whole unmeasured iteration: :meth:`reset`, then :meth:`step`."""
        self.reset()
        self.step()

    def warm_up(self, iterations: int) -> int:
        """Run ``iterations`` whole iterations (they allocate the optimizer state, and the gradients when
        held), then reset; returns the memory held before the next one, bytes."""
        for _ in range(iterations):
            self.run()
        self.reset()
        return held_bytes(self.model, self.inputs, self.optimizer)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    # On the host, so that the copies do not count in what a CUDA step finds allocated.
    return t.detach().to("cpu", copy=True)


@contextlib.contextmanager
def _parameters_kept(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Put every parameter's values back in place afterwards (an optimizer step changes them)."""
    saved = [(p, _host_copy(p)) for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, copy_ in saved:
                p.copy_(copy_)


@contextlib.contextmanager
def _optimizer_kept(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Put the optimizer's state and hyper-parameters back afterwards: tensors in place, state the
    measurement created (AdamW's first step) removed."""
    state = {
        p: {k: (v, _host_copy(v)) if isinstance(v, torch.Tensor) else (v, copy.deepcopy(v)) for k, v in entries.items()}
        for p, entries in optimizer.state.items()
    }
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        yield
    finally:
        with torch.no_grad():
            for p in [p for p in optimizer.state if p not in state]:
                del optimizer.state[p]
            for p, entries in state.items():
                now = optimizer.state[p]
                for k in [k for k in now if k not in entries]:
                    del now[k]
                for k, (orig, saved) in entries.items():
                    if isinstance(orig, torch.Tensor) and orig.shape == saved.shape:
                        orig.copy_(saved)
                        now[k] = orig
                    else:
                        now[k] = saved
        for g, saved_group in zip(optimizer.param_groups, groups):
            for k in [k for k in g if k != "params" and k not in saved_group]:
                del g[k]
            g.update(saved_group)


def _optimizer(
    model: nn.Module, optimizer: OptimizerLike | None, where: str
) -> tuple[torch.optim.Optimizer | None, bool]:
    """The optimizer to step, and whether it was built here (from a factory) for this measurement only."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, False
    if not callable(optimizer):
        raise RematError(
            f"{where}: optimizer={optimizer!r} is neither a torch.optim.Optimizer nor a callable that builds one; "
            "pass the optimizer you train with, or a factory such as torch.optim.AdamW"
        )
    built = optimizer([p for p in model.parameters() if p.requires_grad])
    if not isinstance(built, torch.optim.Optimizer):
        raise RematError(
            f"{where}: optimizer factory {getattr(optimizer, '__name__', optimizer)!r} returned {type(built).__name__}, "
            "not a torch.optim.Optimizer; pass a callable that builds one from a list of parameters, e.g. torch.optim.AdamW"
        )
    return built, True


@contextlib.contextmanager
def iteration(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    grads: Grads | str = Grads.NONE,
    optimizer: OptimizerLike | None = None,
    where: str = "measure",
) -> Iterator[Iteration]:
    """The user's training iteration, for measuring; afterwards the model is exactly as it was.

    Everything :func:`preserved` restores is restored (gradients, buffers, RNG state, modes) and, with
    an optimizer, every parameter's values and the optimizer's state and hyper-parameters. A factory
    is called once, on the parameters that require grad; the optimizer it builds is dropped afterwards.

    Args:
        model: The model.
        inputs: A tensor, a tuple of positional arguments or a dict of keyword arguments.
        loss_fn: Maps the model's output to a scalar loss.
        grads: ``"none"`` (gradients set to ``None`` before each iteration) or ``"held"``.
        optimizer: An optimizer, a factory of one, or ``None`` (no optimizer step).
        where: The caller, the start of every message (``"profile"``, ``"measure"`` ...).

    Raises:
        RematError: For an unknown ``grads`` or an ``optimizer`` that is not one.
    """
    style = parse_grads(grads, where)
    check_loss_fn(loss_fn, where)
    opt, built = _optimizer(model, optimizer, where)
    loop = Loop(style, type(opt).__name__ if opt is not None else None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(preserved(model, inputs))
        if opt is not None:
            params = {id(p): p for p in [*model.parameters(), *(p for g in opt.param_groups for p in g["params"])]}
            stack.enter_context(_parameters_kept(params.values()))
            if not built:
                stack.enter_context(_optimizer_kept(opt))
        yield Iteration(model, inputs, loss_fn, loop, opt, where)
