"""Per-op profile of each block: what every aten op of its forward costs in time and holds for backward.

Selective recompute (NOTE [ Selective recompute semantics ] in ``remat.core.selective``) chooses, inside a
block, which ops' outputs to cache and which to run again in the backward; this module measures what
that choice needs. :func:`profile_ops` runs a few plain forwards of the model on the real batch, and for
every aten op of each block's forward records, in order, its key (NOTE [ Op keys ]), its time, the new
storages it allocates, which of them autograd saves for backward, the ops it reads, the storages it
mutates, and whether it is random or a view. No backward runs.

# NOTE [ Storages, not tensors ]
Bytes are counted per storage, and every storage of the block is named by the op that allocated it:
a view (``transpose``, ``split``, ``_unsafe_view``) and an in-place op (``bernoulli_``, ``div_``)
allocate nothing, their outputs live in their input's storage. What autograd saves is charged to the
op that allocated the saved storage (a softmax output saved by the ``bmm`` after a dropout is charged
to ``_softmax``), so "this op's saved bytes" reads: what keeping this op's output costs in a plain
step. Storages that are neither the block's own nor its inputs (parameters, buffers) are not counted.
An op's output is recognised as new when its storage is not one of its inputs' storages, which also
catches ops that alias without saying so in their schema (``_unsafe_view``). Only saves still held when
the block's forward returns count: a branch whose graph dies inside the forward (a statistic computed
with autograd on and never used, a softmax feeding only ``multinomial``) holds nothing in a plain step,
and counted, it credited op-level policies with freeing it (plans 1.5-2.1x their budget).

# NOTE [ Why not torch's SACEstimator ]
``torch.distributed._tools.sac_estimator.SACEstimator`` (torch 2.13) measures the same things but does not
serve here. It must run under ``FakeTensorMode``, so it never sees the real batch (data-dependent shapes,
real kernel times); of its two time estimates, ``"operator-level-benchmark"`` times each op with
``torch.cuda.Event`` and fails on a CPU-only build ("Tried to instantiate dummy base class Event"), and
``"operator-level-cost-model"`` (roofline) asserts that CUDA is available. It records statistics per
non-leaf module found by ``ModTracker`` rather than per remat block (a named group of sibling modules
is no module), indexes ops by position rather than by the per-op-name counts that a selective
checkpoint policy can match in the forward and the recompute, drops the last op's memory by a
heuristic, and ranks ops greedily for one memory budget instead of giving the planner a menu. So remat
profiles with its own dispatch mode, on the real batch, with the same op keys that
``remat.core.selective.run_selective`` uses.
"""

from __future__ import annotations

import logging
import random
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from remat._json import Reader
from remat.blocks import Block, resolve, unrun_hint
from remat.core.runtime import side_written, suspended
from remat.core.selective import OpKeys, op_name
from remat.core.trace import call_loss, call_model, device_of, mark, preserved, record_memory
from remat.core.tree import leaves as tree_leaves
from remat.core.tree import output_leaves
from remat.core.wrapped import unwrap
from remat.errors import BlockSelectionError, RematError, higher_order_refused

__all__ = ["EXTERNAL", "OpRecord", "BlockOps", "profile_ops"]

log = logging.getLogger(__name__)

EXTERNAL = -1
"""The owner of a storage the block did not allocate (its inputs, parameters, buffers)."""


@dataclass(frozen=True)
class OpRecord:
    """One aten op of a block's forward (NOTE [ Storages, not tensors ]).

    Attributes:
        index: Position in the block's forward, from 0.
        key: ``"<name>#<occurrence>"`` (NOTE [ Op keys ] in ``remat.core.selective``), e.g. ``"gelu#0"``.
        name: Short op name, e.g. ``"gelu"``, ``"native_layer_norm"``.
        ms: Measured time of the op, milliseconds (median over the profiled forwards).
        out_bytes: Bytes of the new storages its outputs live in (0 for a view or an in-place op).
        saved_bytes: Bytes of those new storages that autograd saves for backward (by any op of the block).
        reads: Indices of the ops of this block whose outputs it reads (an in-place op counts as
            producing its output), in first-read order.
        storages: For each storage its outputs live in, the index of the op that allocated it: its
            own index for a new one, ``-1`` for one the block did not allocate.
        writes: The storages it mutates in place, named like ``storages`` (``-1``: a buffer or an input).
        random: Whether it draws from the random number generator (``bernoulli_``, ``native_dropout``, ``rand*``).
        view: Whether its outputs only alias its inputs' storages, mutating nothing (``view``, ``transpose``,
            ``_unsafe_view``).
        freed: When the storages it allocated died in the block's forward: before op ``freed`` ran (a
            temporary; one that died while an op ran counts as dying after it), or ``-1`` when they
            outlived it (saved, returned, held). With ``out_bytes``, this gives
            the bytes alive after each op (NOTE [ Replays of op-level policies ] in ``remat.plan.policies``).
        autocast_cached: A cast that autocast's cache holds (of a leaf that requires grad, a parameter,
            under an enabled autocast with its cache on): alive until the outermost autocast region exits,
            whether the op's output is saved or recomputed.
        temp_bytes: How far memory rose while it ran above the level after it: the temporaries of its kernel
            (a softmax's or a strided convolution's workspace; NOTE [ An op's own temporaries ]).
    """

    index: int
    key: str
    name: str
    ms: float
    out_bytes: int
    saved_bytes: int
    reads: tuple[int, ...] = ()
    storages: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()
    random: bool = False
    view: bool = False
    freed: int = -1
    autocast_cached: bool = False
    temp_bytes: int = 0

    @property
    def fresh(self) -> bool:
        """Whether every output lives in a storage this op allocated (what selective recompute can cache)."""
        return bool(self.storages) and all(s == self.index for s in self.storages)

    def to_json(self) -> dict[str, Any]:
        """The record as plain JSON values."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: Any, reader: Reader | None = None, path: str = "op") -> OpRecord:
        """Inverse of :meth:`to_json`.

        Raises:
            RematError: If a field is missing or of the wrong type.
        """
        return (reader or Reader("ops")).build(cls, data, path)


@dataclass(frozen=True)
class BlockOps:
    """The ops of one block's forward, with what autograd saves.

    Attributes:
        block: The block's index.
        name: The block's name (``Block.name``).
        ops: Its ops in forward order.
        saved_bytes: Bytes autograd saves in the block's forward, once per storage, parameters and
            buffers excluded (the block's own storages and its inputs).
        input_saved_bytes: Of those, bytes of the block's inputs.
        stop: Ops ``[0, stop)`` run again in a recompute: torch's early stop ends it when the last
            tensor the forward saved has been saved again.
        outputs: The ops that allocated the storages of the block's outputs, and of the tensors its modules
            hold as plain attributes (NOTE [ Tensors the block's modules hold ]). Caching one holds its
            output, which the next block may hold anyway (when it saves its input).
        generator_state_bytes: Bytes of the states of the generators other than the default ones that
            its ops draw from (``torch.bernoulli(p, generator=self.g)``), which a segment copies per call.
        fresh_rng: Whether the model's code drew random numbers from the default generator between the
            previous block's end and this block's start (a dropout between blocks): a segment's recording
            keeps another copy of the RNG state for this block's call.
        py_rng: Whether its forward drew from Python's ``random`` or numpy's global generator, which
            torch's selective checkpoint does not restore (no op-level policy for it).
        fills_saved: Whether an op of it fills a storage the block allocated through an argument it does not
            return (``rrelu_with_noise``'s noise): autograd saves that argument before the kernel fills it,
            and torch's selective checkpoint stops its recomputation there (no op-level policy for it: NOTE
            [ Ops that fill a saved argument ] in ``remat.core.runtime``).
    """

    block: int
    name: str
    ops: tuple[OpRecord, ...]
    saved_bytes: int
    input_saved_bytes: int
    stop: int
    outputs: tuple[int, ...] = ()
    generator_state_bytes: int = 0
    fresh_rng: bool = False
    py_rng: bool = False
    fills_saved: bool = False
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index.update((op.key, op.index) for op in self.ops)

    @property
    def own_saved_bytes(self) -> int:
        """Bytes autograd saves of the block's own storages (its inputs excluded): what keeping it holds."""
        return self.saved_bytes - self.input_saved_bytes

    @property
    def fwd_ms(self) -> float:
        """Sum of the ops' times, milliseconds."""
        return sum(op.ms for op in self.ops)

    def index_of(self, key: str) -> int | None:
        """The index of the op with ``key``, or ``None`` if the block has no such op."""
        return self._index.get(key)

    def to_json(self) -> dict[str, Any]:
        """The block's ops as plain JSON values."""
        return {
            "block": self.block,
            "name": self.name,
            "ops": [op.to_json() for op in self.ops],
            "saved_bytes": self.saved_bytes,
            "input_saved_bytes": self.input_saved_bytes,
            "stop": self.stop,
            "outputs": list(self.outputs),
            "generator_state_bytes": self.generator_state_bytes,
            "fresh_rng": self.fresh_rng,
            "py_rng": self.py_rng,
            "fills_saved": self.fills_saved,
        }

    @classmethod
    def from_json(cls, data: Any, reader: Reader | None = None, path: str = "block_ops") -> BlockOps:
        """Inverse of :meth:`to_json`.

        Raises:
            RematError: If a field is missing or of the wrong type.
        """
        return (reader or Reader("ops")).build(cls, data, path)


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of a tensor's storage; ``None`` for one without memory (empty, DTensor, meta)."""
    try:
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):
        return None
    return (ptr, nbytes) if ptr and nbytes else None


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` mutates, from its schema (``Tensor(a!) self``, ``out=``)."""
    out: list[torch.Tensor] = []
    schema = getattr(func, "_schema", None)
    for i, arg in enumerate(getattr(schema, "arguments", ())):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out.extend(_tensors(value))
    return out


@dataclass
class _Op:
    key: str
    name: str
    ns: int
    out_bytes: int
    reads: list[int]
    storages: list[int]
    writes: list[int]
    random: bool
    view: bool
    saved: dict[int, int] = field(default_factory=dict)  # ptr -> bytes of its storages autograd saved
    freed: int = -1  # the number of ops run when the last of the storages it allocated died (-1: alive)
    alive: int = 0  # how many of the storages it allocated are alive
    autocast_cached: bool = False  # OpRecord.autocast_cached


def _autocast_nesting() -> int:
    """How many autocast regions (enabled or not) are open: autocast clears its cache when the outermost
    one exits, and not before."""
    n = int(torch.autocast_increment_nesting())
    torch.autocast_decrement_nesting()
    return n - 1


def _autocast_caches(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether autocast's cache keeps this cast of ``args[0]``: a leaf that requires grad, cast down to a
    half-precision type with the cache on (NOTE [ Autocast's cached weight casts ] in remat.core.probe),
    and kept past the block's forward when an autocast region around the block is still open then
    (``_Recorder.end``). Inside the op, autocast's own flag reads off (its dispatch key is excluded below
    it), so a cast the user writes by hand (``weight.to(torch.bfloat16)``) counts too: on the safe side."""
    t = args[0] if args else None
    if not (isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad and torch.is_autocast_cache_enabled()):
        return False
    return kwargs.get("dtype") in (torch.bfloat16, torch.float16) and t.dtype != kwargs.get("dtype")


class _Run:
    """What one forward of one block did."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        self.keys = OpKeys()
        self.ops: list[_Op] = []
        self.owner: dict[int, int] = {}  # storage pointer -> op that allocated it (the latest one at that address)
        self.last_writer: dict[int, int] = {}  # allocating op -> last op that wrote that storage
        self.producer = WeakTensorKeyDictionary()  # tensor -> op whose output it is
        self.inputs: dict[int, int] = {}
        for t in inputs:
            st = _storage(t)
            if st is not None:
                self.inputs[st[0]] = st[1]
        self.input_saved: dict[int, int] = {}
        # Saves seen so far, with a weak reference to what the autograd node holds: a node that dies before
        # the block's forward ends (a dead branch: an unused statistic, a softmax feeding only multinomial)
        # holds nothing, so only saves still alive at the end count (settle()).
        self.pending: list[tuple[int | None, int, int, Any]] = []
        self.stop = 0
        self.outputs: list[int] = []
        self.generators: dict[int, int] = {}  # its own generators drawn from: id -> bytes of the state
        self.fresh_rng = False  # the model's code drew random numbers since the previous block ended
        self.py_states: Any = None  # Python's and numpy's global RNG states at its start
        self.py_rng = False  # its forward drew from them
        self.fills_saved = False  # an op filled a storage of the block through an argument it does not return
        # Weak references to the storages its ops allocated, whose callbacks record when they die (_Op.freed);
        # dropped when the block's forward ends, so later deaths are not recorded.
        self.lifetimes: list[weakref.ref[torch.UntypedStorage]] | None = []
        self._pending_alive = 0  # storages the op being recorded allocated
        self.in_op = False  # an op of the block is running (a storage dying now dies during it)

    def owner_of(self, ptr: int) -> int:
        return self.owner.get(ptr, EXTERNAL)

    def record(self, func: Any, key: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, ns: int) -> None:
        index = len(self.ops)
        reads: list[int] = []
        in_ptrs: set[int] = set()
        for t in _tensors((args, kwargs)):
            st = _storage(t)
            if st is not None:
                in_ptrs.add(st[0])
            src = self.producer.get(t)
            if src is None and st is not None and st[0] in self.owner:
                # A tensor no recorded op returned (a detach): it reads whatever last wrote its storage.
                src = self.last_writer.get(self.owner[st[0]], self.owner[st[0]])
            if src is not None and src not in reads:
                reads.append(src)
        writes: list[int] = []
        for t in _written(func, args, kwargs):
            st = _storage(t)
            if st is not None and self.owner_of(st[0]) not in writes:
                writes.append(self.owner_of(st[0]))
        side = side_written(func, args, kwargs)
        if side and any(
            (st := _storage(t)) is not None and self.owner_of(st[0]) != EXTERNAL
            for t in _tensors((args, kwargs))
            if id(t) in side
        ):
            self.fills_saved = True  # NOTE [ Ops that fill a saved argument ] in remat.core.runtime
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and gen is not torch.default_generator:
            # It advances a generator of the model's own: state torch's selective checkpoint does not
            # restore, and which remat's segments copy per call (BlockOps.generator_state_bytes).
            self.generators[id(gen)] = gen.get_state().nbytes
            if EXTERNAL not in writes:
                writes.append(EXTERNAL)
        storages: list[int] = []
        out_bytes = 0
        for t in _tensors(out):
            self.producer[t] = index
            st = _storage(t)
            if st is None:
                continue
            ptr, nbytes = st
            if ptr in in_ptrs:
                owner = self.owner_of(ptr)
            else:
                if self.owner.get(ptr) != index:
                    out_bytes += nbytes
                    self._watch(t, index)
                self.owner[ptr] = owner = index
            if owner not in storages:
                storages.append(owner)
        for w in writes:
            if w != EXTERNAL:
                self.last_writer[w] = index
        view = bool(storages) and not writes and index not in storages
        random = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        self.ops.append(
            _Op(
                key,
                op_name(func),
                ns,
                out_bytes,
                reads,
                storages,
                writes,
                random,
                view or bool(getattr(func, "is_view", False)),
                alive=self._pending_alive,
                autocast_cached=func is torch.ops.aten._to_copy.default and _autocast_caches(args, kwargs),
            )
        )
        self._pending_alive = 0

    def _watch(self, t: torch.Tensor, index: int) -> None:
        if self.lifetimes is None:
            return

        def died(_ref: Any, run: _Run = self, index: int = index) -> None:
            if run.lifetimes is not None and index < len(run.ops):
                op = run.ops[index]
                op.alive -= 1
                if op.alive == 0:
                    # The first op that ran without it: the next one, if it died while an op ran.
                    op.freed = len(run.ops) + (1 if run.in_op else 0)

        try:
            self.lifetimes.append(weakref.ref(t.untyped_storage(), died))
        except (RuntimeError, NotImplementedError, TypeError):
            return
        self._pending_alive += 1

    def saved(self, t: torch.Tensor, packed: torch.Tensor) -> None:
        self.stop = len(self.ops)
        st = _storage(t)
        if st is None:
            return
        ptr, nbytes = st
        owner = self.owner.get(ptr)
        if owner is not None or ptr in self.inputs:
            self.pending.append((owner, ptr, nbytes, weakref.ref(packed)))

    def settle(self) -> None:
        for owner, ptr, nbytes, ref in self.pending:
            if ref() is None:
                continue
            if owner is not None:
                self.ops[owner].saved[ptr] = nbytes
            else:
                self.input_saved[ptr] = nbytes
        self.pending = []


class _Recorder(TorchDispatchMode):
    """Records the ops of each block's forward; outside the blocks it only passes ops through."""

    def __init__(self, n_blocks: int, marked: bool = False) -> None:
        super().__init__()
        self.marked = marked  # leave a marker around each op of a block, for the memory profiler (_op_temps)
        self.runs: list[_Run | None] = [None] * n_blocks
        self.current: _Run | None = None
        self.current_index = -1
        self.drew_outside = False  # a random op of the default generator ran outside the blocks

    def start(self, i: int, inputs: list[torch.Tensor]) -> None:
        # A block whose forward runs again in the same step (shared weights) is recorded the first time.
        if self.current is None and self.runs[i] is None:
            self.current = self.runs[i] = _Run(inputs)
            self.current_index = i
            self.current.fresh_rng = self.drew_outside
            self.current.py_states = _py_states()
        self.drew_outside = False

    def end(self, i: int, out: Any, held: Sequence[torch.Tensor] = ()) -> None:
        run = self.current
        if run is None or self.current_index != i:
            return
        run.py_rng = _py_states() != run.py_states
        run.settle()
        run.lifetimes = None  # what dies after the block's forward ends is no temporary of it
        if _autocast_nesting() == 0:  # the block's own region exited: autocast cleared its cache
            for op in run.ops:
                op.autocast_cached = False
        # NOTE [ Tensors the block's modules hold ]: held past the block like its outputs.
        for t in (*(leaf for leaf in output_leaves(out) if isinstance(leaf, torch.Tensor)), *held):
            st = _storage(t)
            owner = run.owner.get(st[0], EXTERNAL) if st is not None else EXTERNAL
            if owner != EXTERNAL and owner not in run.outputs:
                run.outputs.append(owner)
        self.current, self.current_index = None, -1
        self.drew_outside = False

    def model_output(self, out: Any) -> None:
        """Count the storages of the model's output that a block's op made among that block's outputs
        (NOTE [ Block tensors in the model's output ])."""
        leaves = [leaf for leaf in output_leaves(out) if isinstance(leaf, torch.Tensor)]
        for run in self.runs:
            if run is None:
                continue
            for leaf in leaves:
                index = run.producer.get(leaf)  # by identity: no other tensor's address can match
                if index is None:
                    continue
                for owner in run.ops[index].storages:
                    if owner != EXTERNAL and owner not in run.outputs:
                        run.outputs.append(owner)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        packed = t.detach()
        if self.current is not None:
            self.current.saved(t, packed)
        return packed  # NOTE [ Saved outputs make cycles ] in remat.core.probe

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        run = self.current
        key = run.keys(func) if run is not None else None
        if run is None or key is None:
            if run is None and torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
                gen = kwargs.get("generator")
                self.drew_outside |= gen is None or gen is torch.default_generator
            return func(*args, **kwargs)
        cuda = [t.device for t in _tensors((args, kwargs)) if t.device.type == "cuda"]
        if cuda:
            torch.cuda.synchronize(cuda[0])
        if self.marked:
            mark(f"op<{self.current_index}:{len(run.ops)}")
        t0 = time.perf_counter_ns()
        run.in_op = True
        try:
            out = func(*args, **kwargs)
        finally:
            run.in_op = False
        if self.marked:
            mark(f"op>{self.current_index}:{len(run.ops)}")
        if cuda:
            torch.cuda.synchronize(cuda[0])
        ns = time.perf_counter_ns() - t0
        run.record(func, key, args, kwargs, out, ns)
        return out


def _py_states() -> tuple[Any, ...]:
    """Python's and (if imported) numpy's global RNG states, comparable with ``==``."""
    np = sys.modules.get("numpy")
    if np is None:
        return (random.getstate(),)
    _, keys, pos, *_ = np.random.get_state()
    return random.getstate(), keys.tobytes(), pos


# NOTE [ Tensors the block's modules hold ]
# A block may bind a tensor it computes to one of its modules as a plain attribute, which holds it past the
# block's backward: ``torch.nn.utils.prune`` recomputes ``module.weight = weight_orig * weight_mask`` in a
# forward pre-hook. Like the block's output, recomputing such a tensor frees nothing, and its replay makes a
# second copy while the module still holds the forward's: op-level policies that recomputed the pruned
# weights' ``mul`` measured 1.08-1.21x their prediction (the smallest plan of five pruned MLP layers 1.17x
# its budget). So the ops that allocated them count among ``BlockOps.outputs`` (NOTE [ The block's output is
# held anyway ] in ``remat.plan.policies``: a policy caches them where autograd saves them whole).
def _attribute_tensors(mods: Sequence[nn.Module]) -> list[torch.Tensor]:
    """The tensors the modules of a block (and their sub-modules) hold as plain attributes, not as
    parameters or buffers (NOTE [ Tensors the block's modules hold ])."""
    out: list[torch.Tensor] = []
    for mod in mods:
        for sub in mod.modules():
            out.extend(v for v in vars(sub).values() if isinstance(v, torch.Tensor))
    return out


# NOTE [ Block tensors in the model's output ]
# A tensor a block makes may reach the model's output without being the block's output: HF's
# ``output_attentions=True`` collects each attention module's probabilities with a forward hook on that
# sub-module (transformers' output recorder), so the model returns them and they are held through the
# backward, while the layer returns only its hidden states. Autograd saves the same probabilities (the
# ``attn @ v`` matmul's input): an op-level policy that recomputed them made a second copy in the backward
# while the model's output still held the first (Whisper with eager attention, every menu policy of an
# encoder layer 1.019-1.023x its prediction, the 50% plan 1.066x its prediction and 1.014x its budget). So
# the ops that allocated them count among ``BlockOps.outputs`` too, found by the tensor's identity
# (``_Run.producer``) after the model's forward: like a returned output, a policy caches them where
# autograd saves them whole (NOTE [ The block's output is held anyway ] in ``remat.plan.policies``).
def _one_forward(
    model: nn.Module, inputs: Any, members: list[list[nn.Module]], block_list: Sequence[Block], marked: bool = False
) -> tuple[list[_Run], Any]:
    rec = _Recorder(len(members), marked)
    handles = []
    for i, mods in enumerate(members):

        def pre(_m: nn.Module, args: Any, kwargs: Any, i: int = i) -> None:
            rec.start(i, _tensors((args, kwargs)))

        def post(_m: nn.Module, _args: Any, out: Any, i: int = i, mods: list[nn.Module] = mods) -> None:
            rec.end(i, out, _attribute_tensors(mods))

        handles.append(mods[0].register_forward_pre_hook(pre, with_kwargs=True))
        # First of its forward hooks: the model's own run outside the block's forward, which is what a policy
        # recomputes (NOTE [ Forward hooks run outside the block ] in remat.profile.profiler).
        handles.append(mods[-1].register_forward_hook(post, always_call=True, prepend=True))
    called: set[int] = set()  # NOTE [ Why a block did not run ] in remat.blocks
    handles.append(register_module_forward_pre_hook(lambda m, _args: called.add(id(m))))
    try:
        with (
            higher_order_refused(
                "profile: the model",
                "remat cannot profile this model: apply a strategy to the blocks that do not call it, without a "
                "profile (remat.apply(model, remat.selective([...])))",
            ),
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t),
            rec,
        ):
            out = call_model(model, inputs, "profile")
        rec.model_output(out)
    finally:
        for h in handles:
            h.remove()
    missing = [block_list[i] for i, r in enumerate(rec.runs) if r is None]
    if missing:
        raise BlockSelectionError(
            f"profile: block {missing[0].name!r} did not run in the forward of {type(model).__name__}: "
            f"{unrun_hint(model, missing[0], called)}the model skipped "
            "it (an early exit, layers skipped at random as with LayerDrop: HF's layerdrop / encoder_layerdrop, a "
            "child its layer calls only under an option or on some calls: x-transformers' optional projections "
            "with split=True, DPT's first fusion layer without its first residual layer) or called its forward "
            "directly (layer.forward(x) bypasses the module hooks the profile needs); a model must run every "
            "block once per step to be profiled: select blocks that always run through their __call__ "
            "(split=False, include=...), set a LayerDrop probability to 0 to profile and plan, or apply a strategy "
            "that needs no profile (remat.apply(model, remat.sqrt()))"
        )
    return [r for r in rec.runs if r is not None], out


def _same_ops(block: Block, runs: list[_Run]) -> None:
    """Refuse a block whose forwards ran different ops."""
    keys = [op.key for op in runs[0].ops]
    for r, run in enumerate(runs[1:], 1):
        other = [op.key for op in run.ops]
        if other != keys:
            at = next((j for j, (a, b) in enumerate(zip(keys, other)) if a != b), min(len(keys), len(other)))
            seen = keys[at] if at < len(keys) else "its end"
            then = other[at] if at < len(other) else "its end"
            raise RematError(
                f"profile: block {block.name!r} ran different ops in forward 1 and forward {r + 1} "
                f"(op {at}: {seen} then {then}); selective recompute needs a forward that runs the same ops "
                "every time (no data-dependent control flow, no layer skipped at random inside it); profile with "
                "remat.profile(..., ops=False), which offers no op-level policies and keeps or recomputes such a "
                "block whole"
            )


def _block_ops(block: Block, runs: list[_Run], temps: Sequence[int] = ()) -> BlockOps:
    """The block's record from its timed forwards, with its ops' ``temp_bytes`` (NOTE [ An op's own temporaries ])."""
    _same_ops(block, runs)
    first = runs[0]
    records = []
    for j, op in enumerate(first.ops):
        ms = statistics.median(run.ops[j].ns for run in runs) / 1e6
        records.append(
            OpRecord(
                index=j,
                key=op.key,
                name=op.name,
                ms=ms,
                out_bytes=op.out_bytes,
                saved_bytes=sum(op.saved.values()),
                reads=tuple(op.reads),
                storages=tuple(op.storages),
                writes=tuple(op.writes),
                random=op.random,
                view=op.view,
                freed=op.freed,
                autocast_cached=op.autocast_cached,
                temp_bytes=temps[j] if j < len(temps) else 0,
            )
        )
    input_saved = sum(first.input_saved.values())
    return BlockOps(
        block=block.index,
        name=block.name,
        ops=tuple(records),
        saved_bytes=sum(r.saved_bytes for r in records) + input_saved,
        input_saved_bytes=input_saved,
        stop=first.stop,
        outputs=tuple(sorted(first.outputs)),
        generator_state_bytes=sum(first.generators.values()),
        fresh_rng=first.fresh_rng,
        py_rng=any(run.py_rng for run in runs),
        fills_saved=any(run.fills_saved for run in runs),
    )


# NOTE [ An op's own temporaries ]
# A kernel may allocate and free memory while it runs, beyond its outputs: the CPU softmax an output-sized
# buffer, a convolution over a transposed input a contiguous copy. The storages' lifetimes
# (``OpRecord.freed``) do not see them, and the block's measured forward peak has them only where they top
# the forward: a softmax's buffer right before the op making the block's largest live set (``softmax(x) * d``)
# sits one tensor under the peak. A policy caching that ``mul`` moves the replay's peak onto the softmax,
# buffer included (fuzz seed 411's O1{..|mul#2}: 1.056x its prediction, 1.058x its budget; helper-98 read
# it as the replay's leftovers alive under the backward's first ``mm``, but they die before it, helper-101).
# So one more forward runs under the memory profiler with a marker around each op of a block, and
# ``temp_bytes`` is the op's highest level less the level after it; its time is not used (the markers and
# the profiler cost time). ``remat.plan.policies`` charges it at that op of a replay unless the op is cached.
def _op_temps(
    model: nn.Module, inputs: Any, members: list[list[nn.Module]], block_list: Sequence[Block]
) -> tuple[list[_Run], list[list[int]]]:
    """One forward under the memory profiler: its runs and each block's ops' ``temp_bytes``."""
    got: list[list[_Run]] = []

    def step() -> None:
        runs, output = _one_forward(model, inputs, members, block_list, marked=True)
        got.append(runs)
        del output

    trace = record_memory(step, device_of(model, inputs))
    times = trace.mark_times()
    temps: list[list[int]] = []
    for i, run in enumerate(got[0]):
        row = []
        for j in range(len(run.ops)):
            t0, t1 = times.get(f"op<{i}:{j}"), times.get(f"op>{i}:{j}")
            row.append(max(0, trace.peak_between(t0[0], t1[0]) - trace.level_at(t1[0])) if t0 and t1 else 0)
        temps.append(row)
    return got[0], temps


def profile_ops(
    model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor], blocks: Sequence[Block], *, rounds: int = 3
) -> tuple[BlockOps, ...]:
    """Profile every aten op of each block's forward on the real batch (NOTE [ Storages, not tensors ]).

    Runs ``rounds`` plain forwards of the model (no backward) with gradients enabled, any remat plan
    applied to it suspended; each op's time is the median over the forwards. One more forward runs
    under the memory profiler for each op's temporaries (NOTE [ An op's own temporaries ]). The model
    is left as it was: buffers, gradients, RNG state, train/eval mode.

    Args:
        model: The model, on the device to profile on, in the mode it trains in (dropout active).
        inputs: A tensor, a tuple of positional arguments or a dict of keyword arguments.
        loss_fn: Maps the model's output to a scalar loss; called once, on the first forward's output, to
            check it (no backward runs).
        blocks: The blocks to profile (``remat.blocks(model)``).
        rounds: Forwards to run, >= 1.

    Returns:
        One :class:`BlockOps` per block, in the order of ``blocks``.

    Raises:
        RematError: If ``rounds`` < 1, a block does not run in the forward, ``loss_fn`` does not return a
            scalar that requires grad, or a block runs different ops in two forwards.
    """
    if rounds < 1:
        raise RematError(f"profile: rounds={rounds} must be >= 1")
    if unwrap(model) is not model:
        model = unwrap(model)
    block_list = tuple(blocks)
    if not block_list:
        raise BlockSelectionError("profile: no blocks to profile; select at least one block")
    members = resolve(model, block_list)
    t0 = time.perf_counter()
    runs: list[list[_Run]] = []
    with suspended(model), preserved(model, inputs):
        for r in range(rounds):
            run, output = _one_forward(model, inputs, members, block_list)
            runs.append(run)
            if r == 0:
                with torch.enable_grad():
                    call_loss(loss_fn, output, "profile")  # checked here: the first call of the user's loss
            del output
        mem_run, temps = _op_temps(model, inputs, members, block_list)
    for i, b in enumerate(block_list):
        _same_ops(b, [*(run[i] for run in runs), mem_run[i]])  # its temporaries are per op: the same ops
    out = tuple(_block_ops(b, [run[i] for run in runs], temps[i]) for i, b in enumerate(block_list))
    log.debug("profile_ops: %d blocks, %d forwards in %.3fs", len(out), rounds, time.perf_counter() - t0)
    return out
