"""The forward probe: hooks that report where each block's forward and backward start and end.

The profile times blocks and attributes memory with it; the timeline marks its events.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.module import _global_backward_hooks, _global_backward_pre_hooks
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm

from remat.blocks import Block, resolve
from remat.core.tree import leaves as tree_leaves
from remat.core.tree import output_leaves
from remat.errors import RematError

__all__ = [
    "Event",
    "Callback",
    "Probe",
    "probe",
    "storages",
    "sequence_mark",
    "made_since",
    "held_storages",
    "restored_buffer",
]


_MARKER = torch.empty(0, requires_grad=True)


# torch's own counter, read without making a node (a view under enable_grad: 9 us a call, once per
# checkpointed call); where this torch lacks it, the node of a view tells.
_NEXT_SEQUENCE_NR = getattr(torch._C._autograd, "_get_sequence_nr", None)


def sequence_mark() -> int:
    """The sequence number autograd gives the next node it makes (NOTE [ In-place edits of a member's output ])."""
    if _NEXT_SEQUENCE_NR is not None:
        return int(_NEXT_SEQUENCE_NR())
    with torch.enable_grad():
        node = _MARKER.view(0).grad_fn
    assert node is not None
    return int(node._sequence_nr())


def made_since(t: torch.Tensor, mark: int, held: set[int] | None = None) -> bool:
    """Whether ``t`` (or the tensor it views) got its autograd node after ``sequence_mark()`` returned ``mark``;
    for a tensor with no node (made with no gradient to track: a frozen layer's output on an input that needs
    none, or under ``torch.no_grad``), whether its storage is none of ``held``, the data pointers of what the
    call could have returned without making it (``held_storages``; NOTE [ In-place edits of a member's
    output ] in ``remat.core.runtime``). Without ``held``, a node-less tensor is not made by the call."""
    base = t._base if t._base is not None else t
    node = base.grad_fn
    if node is not None:
        return int(node._sequence_nr()) >= mark
    if held is None or t.layout is not torch.strided or base.requires_grad:
        return False  # a leaf that requires grad is a parameter or an input, never a call's new tensor
    try:
        ptr = base.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    return bool(ptr) and ptr not in held


def held_storages(modules: Sequence[nn.Module], args: Any) -> set[int]:
    """Data pointers of the storages a call of ``modules`` with ``args`` could return without making them:
    its tensor arguments, the modules' parameters and buffers, and the tensors in their plain attributes
    (a cache, a table: one level of lists, tuples and dicts), read after the call (a cache it set then
    counts as held)."""
    found: list[Any] = [a for a in tree_leaves(args) if isinstance(a, torch.Tensor)]
    for mod in modules:
        for sub in mod.modules():
            found += sub._parameters.values()
            found += sub._buffers.values()
            for name, value in vars(sub).items():
                if name in ("_parameters", "_buffers", "_modules"):
                    continue
                if isinstance(value, torch.Tensor):
                    found.append(value)
                elif isinstance(value, (list, tuple)):
                    found += [v for v in value if isinstance(v, torch.Tensor)]
                elif isinstance(value, dict):
                    found += [v for v in value.values() if isinstance(v, torch.Tensor)]
    return set(storages(found, set()))


# NOTE [ Autocast's cached weight casts ]
# Under ``torch.autocast`` with its cache enabled (the default), the low-precision cast of a leaf
# tensor that requires grad (a parameter) is cached and reused by every later cast of it until the
# outermost autocast region exits. Where the user's region holds the whole loop (profile, plan and
# measure, backward included), the casts made in the warm-up are held before every later iteration,
# like the parameters: a block or sub-module that saves one (its matmul's weight) does not free it when
# checkpointed, and its recomputation finds it in the cache. Counting them in ``saved`` made every
# sub-module checkpoint look that much cheaper (tiny GPT-2 at 50%: predicted 1,450,832 B, measured
# 1,609,232 B, 1.105x its budget; each attention's ``saved_bytes`` held 32 KiB of casts, each MLP's 64
# KiB); a whole block's ``keep_bytes`` is measured and was right. So a saved tensor that is (a view of)
# such a cast made before the probe was installed is not counted, as parameters are not. With the cache
# disabled, or a cast made in the iteration itself, the cast is the block's and counted.
# The same cache kept what a recomputation cast of the fresh leaves remat's replay makes of a segment's
# inputs (``detach().requires_grad_()``), and, through the cast's graph, the leaf (the segment's input):
# each replay left them behind to the end of the region (BERT: 36 KiB a layer, 1.074x the budget at the
# smallest feasible one; T5 1.041x); under an autocast with its cache enabled the replay takes a view of
# each such leaf instead, which autocast does not cache (``remat.core.runtime``, ``_Frame._arguments``).


def autocast_cached(t: torch.Tensor, mark: int) -> bool:
    """Whether ``t`` is (a view of) a parameter's cast in autocast's cache, made before ``sequence_mark()``
    returned ``mark`` (NOTE [ Autocast's cached weight casts ])."""
    # (Not ``torch.is_autocast_enabled``: a pack hook runs inside the op, below autocast, where it reads False.)
    if not torch.is_autocast_cache_enabled():
        return False
    base = t._base if t._base is not None else t
    node = base.grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0" or int(node._sequence_nr()) >= mark:
        return False
    nxt = node.next_functions
    return len(nxt) == 1 and nxt[0][0] is not None and type(nxt[0][0]).__name__ == "AccumulateGrad"


class Event(str, Enum):
    """What the probe reports, with the index of the block (or sub-module) it happened to.

    The values are one letter, so ``f"{event}{index}"`` makes a short profiler mark ("F3").
    """

    FORWARD = "F"  # a block's forward starts
    FORWARD_END = "f"  # a block's forward returns
    BACKWARD = "B"  # gradients reach a block's outputs: its backward starts
    BACKWARD_END = "b"  # gradients reach a block's inputs: its backward ends
    SUB = "S"  # an attention/FFN sub-module's forward starts
    SUB_END = "s"  # it returns
    # Gradients reach a sub-module's outputs (tracked runs only): its backward starts, and with it the
    # recomputation of a sub-module checkpointed alone (NOTE [ Sub-module recomputation peak ]).
    SUB_BACKWARD = "T"
    # The backward first unpacks a tensor the block saved (tracked runs only): where a checkpoint over a
    # segment ending with the block replays it, above what the block's backward allocated before then (the
    # gradient buffers of an in-place op on a view, CopySlices; NOTE [ Replay level ] in remat.profile.profiler).
    UNPACK = "U"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


Callback = Callable[[Event, int], None]


def _strided(leaves: Any) -> Iterator[Any]:
    """The leaves, with a sparse tensor (COO, CSR/CSC, BSR/BSC), which has no storage of its own, replaced by
    the strided tensors that hold its data (its indices and values): their bytes are what it holds."""
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.layout is torch.sparse_coo:
            yield from (leaf._indices(), leaf._values())
        elif isinstance(leaf, torch.Tensor) and leaf.layout in (torch.sparse_csr, torch.sparse_bsr):
            yield from (leaf.crow_indices(), leaf.col_indices(), leaf.values())
        elif isinstance(leaf, torch.Tensor) and leaf.layout in (torch.sparse_csc, torch.sparse_bsc):
            yield from (leaf.ccol_indices(), leaf.row_indices(), leaf.values())
        else:
            yield leaf


def _live_storages(obj: Any, exclude: set[int], out: bool = False) -> Iterator[tuple[int, torch.UntypedStorage]]:
    """(data pointer, storage) of every tensor in ``obj`` (a pytree; ``out``: what a block returns, read
    with ``output_leaves``) whose pointer is not in ``exclude``."""
    for leaf in _strided(output_leaves(obj) if out else tree_leaves(obj)):
        if isinstance(leaf, torch.Tensor):
            try:
                # A DTensor (FSDP2's sharded parameters) or a freed storage has no data pointer: skip it.
                st = leaf.untyped_storage()
                ptr = st.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            if ptr and ptr not in exclude:
                yield ptr, st


def storages(obj: Any, exclude: set[int], out: bool = False) -> dict[int, int]:
    """Storage data pointer -> bytes of every tensor in ``obj`` (a pytree; ``out``: as ``_live_storages``) not in ``exclude``."""
    return {ptr: st.nbytes() for ptr, st in _live_storages(obj, exclude, out)}


def _storage_refs(obj: Any, exclude: set[int], out: bool = False) -> dict[int, weakref.ref[torch.UntypedStorage]]:
    """Storage data pointer -> weak reference to the storage, for every tensor in ``obj`` not in ``exclude``.

    A pointer alone does not name a storage over time: the allocator hands a freed block's address to
    the next allocation of its size (a ReLU's output where a norm's output was), and a storage's weak
    reference dies with it (torch keeps one Python object per live storage).
    """
    return {ptr: weakref.ref(st) for ptr, st in _live_storages(obj, exclude, out)}


def _wrapped_args(module: nn.Module, args: tuple[Any, ...]) -> set[int]:
    """Ids of the positional tensor arguments that torch hands ``module``'s forward as new tensors, for
    its full backward (pre-)hooks (``BackwardHook.setup_input_hook``; NOTE [ Links are what the forward
    sees ])."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return set()
    try:
        full = module._get_backward_hooks()[0] if module._backward_hooks or _global_backward_hooks else []
        pre = module._get_backward_pre_hooks() if module._backward_pre_hooks or _global_backward_pre_hooks else []
    except (AttributeError, RuntimeError):  # another torch: assume wrapped where any backward hook is set
        full = pre = list(module._backward_hooks.values()) + list(module._backward_pre_hooks.values())
    return {id(t) for t in tensors} if full or pre else set()


def restored_buffer(owner: nn.Module, name: str) -> bool:
    """Whether ``owner``'s own buffer ``name`` is state its forward updates that remat restores around
    each recomputation without asking (``allow_stateful``): a norm's running statistics, spectral norm's
    power-iteration vectors (``torch.nn.utils.parametrizations.spectral_norm``'s ``_u``/``_v``, the older
    ``spectral_norm``'s ``weight_u``/``weight_v``). A replay then computes what the forward did, and the
    buffers are left as the forward left them (helper-46: bitwise, ``_u``/``_v`` included)."""
    if isinstance(owner, (_NormBase, _SpectralNorm)):
        return True
    return any(
        isinstance(hook, SpectralNorm) and name in (f"{hook.name}_u", f"{hook.name}_v")
        for hook in owner._forward_pre_hooks.values()
    )


def _plain_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    # Buffers other than those remat restores around recomputation without asking (restored_buffer).
    for prefix, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if not restored_buffer(sub, name):
                yield (f"{prefix}.{name}" if prefix else name), buf


# NOTE [ Buffer copies outside the trace ]: the tracked run is the run whose allocations the profile
# records, so the copy of a block's buffers it takes to tell a stateful forward must not be a torch
# allocation: a copy made with clone() was alive through the block's forward and counted as the
# block's memory (HF ImageGPT's 1 MiB causal-mask buffer per layer: the unplanned peak profiled 18%
# above what remat.measure reports, every budget share and prediction off with it). A CPU buffer is
# copied as Python bytes, which the torch profiler does not see; another (a CUDA buffer's host copy is
# no device allocation) goes to the host first.
def _buffer_copy(buf: torch.Tensor) -> bytes | torch.Tensor:
    t = buf.detach()
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        try:
            return t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        except (RuntimeError, TypeError):  # no numpy, or a dtype without a byte view: a tensor copy
            pass
    return t.clone()


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, for sparse tensors too (torch has no sparse kernel for it: a sparse buffer made the
    profile raise a raw ``NotImplementedError``). Sparse tensors compare by their stored indices and
    values as they are, without coalescing (no allocation): the same values stored otherwise count as
    changed, which only makes the block count as stateful (on the safe side)."""
    if a.layout != b.layout or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.layout == torch.sparse_coo:
        return torch.equal(a._indices(), b._indices()) and torch.equal(a._values(), b._values())
    if a.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (torch.Tensor.crow_indices, torch.Tensor.col_indices, torch.Tensor.values)
        return all(torch.equal(f(a), f(b)) for f in parts)
    if a.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (torch.Tensor.ccol_indices, torch.Tensor.row_indices, torch.Tensor.values)
        return all(torch.equal(f(a), f(b)) for f in parts)
    return torch.equal(a, b)


def _same_as_copy(buf: torch.Tensor, copy: bytes | torch.Tensor) -> bool:
    if isinstance(copy, bytes):
        t = buf.detach()
        return t.is_contiguous() and t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes() == copy
    return same_values(buf.detach(), copy)


class Probe:
    """Hooks on blocks and sub-modules that report forward/backward boundaries and saved tensors."""

    def __init__(self, model: nn.Module, block_list: Sequence[Block], callback: Callback, *, track: bool) -> None:
        self.model = model
        self.members = resolve(model, block_list)
        self.subs = [model.get_submodule(f) for b in block_list for f in (*b.attention_fqns, *b.ffn_fqns)]
        self.sub_names = [f for b in block_list for f in (*b.attention_fqns, *b.ffn_fqns)]
        self.block_names = [", ".join(b.fqns) for b in block_list]
        self.callback = callback
        self.track = track
        # Parameters and buffers are held before the step: a tensor the forward saves that views one (HF
        # ImageGPT's causal-mask slice of its 1 MiB `bias` buffer, saved by torch.where) costs the step
        # nothing, and checkpointing its block frees none of it (counting the whole storage predicted
        # attention-only plans at 0.66x their measured peak, 1.52x their budget).
        self.params = set(storages([*model.parameters(), *model.buffers()], set()))
        # Casts in autocast's cache made before this mark are held like the parameters (NOTE [ Autocast's
        # cached weight casts ]).
        self._cast_mark = sequence_mark()
        n, m = len(block_list), len(self.subs)
        self.saved: list[dict[int, int]] = [{} for _ in range(n + m)]
        # Of them, the casts in autocast's cache made in this iteration (autocast_cached with no mark): the
        # cache holds them until its region exits, whatever the checkpoint (remat.profile.profiler's
        # sub-module saved_bytes leaves them out).
        self.cast_saved: list[dict[int, int]] = [{} for _ in range(n + m)]
        # The saves of each slot's running call: (pointer, weak reference to what the autograd node holds),
        # settled when the call returns (NOTE [ Saves of nodes that died in the forward ]).
        self._saves: list[list[tuple[int, weakref.ref[torch.Tensor]]]] = [[] for _ in range(n + m)]
        self.inputs: list[dict[int, int]] = [{} for _ in range(n + m)]
        self.outputs: list[dict[int, int]] = [{} for _ in range(n + m)]
        # Of each block's outputs, those edited in place after they were made (``_version > 0``: an
        # ``F.silu(x, inplace=True)`` closing the block): their storage exists before the edit, which may
        # save a tensor (silu_ saves a copy of its input), so a replay that stops there has made them.
        self.edited_outputs: list[dict[int, int]] = [{} for _ in range(n + m)]
        # Of each sub-module's inputs: storage data pointer -> a number that names the storage over the
        # whole step (the same tensor taken by several sub-modules: T5's position bias), see _identity.
        self.input_ids: list[dict[int, int]] = [{} for _ in range(n + m)]
        # NOTE [ Inputs a block saves are storages, not addresses ]: of each sub-module's inputs, those its
        # block saves (the same storage alive in a save when the block returns), settled by _settle; the
        # storages each slot's saves hold (pointer -> weak reference), and each sub-module's block and input
        # storages, to settle them.
        self.inputs_saved_by_block: list[set[int]] = [set() for _ in range(n + m)]
        self._saved_storages: list[dict[int, weakref.ref[torch.UntypedStorage]]] = [{} for _ in range(n + m)]
        self._sub_inputs: dict[int, tuple[int, dict[int, weakref.ref[torch.UntypedStorage]]]] = {}
        self._identities: list[weakref.ref[torch.UntypedStorage]] = []
        self.calls = [0] * n
        self.order: list[int] = []
        # Calls made inside the backward (the model recomputes the block itself: torch.utils.checkpoint
        # in its forward, HF's gradient_checkpointing_enable) and forwards run with gradients off.
        self.backward_calls = [0] * n
        self.no_grad = [False] * n
        # Links between blocks (BlockProfile.linked): the previous block's output tensors (weakly, with
        # their versions) and the storages that existed before the previous block started.
        self.linked = [True] * n
        self.unlinked = [0] * n  # bytes of the inputs that made a block not linked
        self._unlinked_storages: list[dict[int, int]] = [{} for _ in range(n)]  # their storages: ptr -> bytes
        self._prev_outs: list[tuple[weakref.ref[torch.Tensor], int]] = []
        self._prev_out_storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}  # their storages, at its end
        # Each block's outputs as its last module's forward returned them, before the model's forward
        # hooks (NOTE [ Links are what the forward sees ]): block index -> (tensor, version) pairs.
        self._raw_outs: dict[int, list[tuple[weakref.ref[torch.Tensor], int]]] = {}
        # Storages (pointer -> weak reference, see _storage_refs) of the previous block's inputs, of every
        # block input and output so far, and of those seen before the previous block started.
        self._prev_inputs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._seen: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._seen_before_prev: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        # Stateful forwards (BlockProfile.stateful): buffers before each block's forward; for the sub-modules
        # (slots n..n+m), the mutable arguments they change (NOTE [ Arguments changed by the call ]).
        self.stateful: list[tuple[str, ...]] = [()] * (n + m)
        self._buffers_before: dict[int, dict[str, tuple[torch.Tensor, int, bytes | torch.Tensor]]] = {}
        # Mutable non-tensor arguments of each block at its call (NOTE [ Arguments changed by the call ]).
        self._args_before: dict[int, list[tuple[Any, Any]]] = {}
        self._active: list[int] = []
        # Blocks and sub-modules that edit a tensor argument in place (a recomputation would edit it again).
        self.edits_input = [False] * (n + m)
        # Blocks whose every edited argument is an output of the block before them, as that block returned
        # it (a ReLU(inplace=True) after a Linear in a Sequential): BlockProfile.edits_own_link.
        self.edits_own_link = [True] * n
        self._prev_out_args: dict[int, set[int]] = {}  # block index -> ids of its arguments that are such outputs
        self._marks: dict[int, int] = {}  # block index -> autograd's sequence mark when its forward started
        # block index -> held_storages of its call, read when its forward returned (made_since)
        self._held: dict[int, set[int]] = {}
        self._arg_versions: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self._fired: set[tuple[Event, int]] = set()
        # Whether the backward unpacked anything each block saved: a block that saved tensors none of which the
        # backward read is one the backward does not reach (its output feeds the loss through operations
        # without a gradient, an argmin: BlockProfile.backward).
        self.unpacked = [False] * (n + m)
        # Whether any tensor each block returned requires a gradient (as its forward returned it; True where
        # not seen): NOTE [ Blocks whose outputs need no gradient ].
        self.out_grad = [True] * (n + m)
        self.handles: list[Any] = []
        self.tensor_handles: list[Any] = []  # hooks on the step's tensors (inputs may outlive the step)

    def _once(self, kind: Event, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            if (kind, i) not in self._fired:
                self._fired.add((kind, i))
                self.callback(kind, i)

        return hook

    def _pre(self, slot: int, kind: Event, index: int) -> Callable[..., None]:
        def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.callback(kind, index)
            self._active.append(slot)
            if self.track:
                self.inputs[slot].update(storages((args, kwargs), self.params, out=True))
                if kind is Event.SUB:
                    block = next((a for a in reversed(self._active[:-1]) if a < len(self.members)), None)
                    refs = self._sub_inputs.setdefault(slot, (-1 if block is None else block, {}))[1]
                    for ptr, st in _live_storages((args, kwargs), self.params, out=True):
                        self.input_ids[slot][ptr] = self._identity(st)
                        refs[ptr] = weakref.ref(st)
                self._arg_versions[slot] = [
                    (t, t._version) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                ]
            if kind is Event.FORWARD:
                self.calls[index] += 1
                self.order.append(index)
                if torch._C._current_graph_task_id() == -1 and not torch.is_grad_enabled():
                    self.no_grad[index] = True
                if self.track:
                    self._link(index, args, kwargs)
                    self._marks[index] = sequence_mark()
                    self._held[index] = set(storages((args, kwargs), set()))
                for t in tree_leaves((args, kwargs)):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        self.tensor_handles.append(t.register_hook(self._once(Event.BACKWARD_END, index)))

        return hook

    def _identity(self, st: torch.UntypedStorage) -> int:
        """A number for a live storage, the same for as long as it lives (a pointer alone is not: see
        _storage_refs)."""
        for number, ref in enumerate(self._identities):
            if ref() is st:
                return number
        self._identities.append(weakref.ref(st))
        return len(self._identities) - 1

    def _in_backward(self, index: int) -> Callable[..., None]:
        def hook(_mod: nn.Module, _args: Any) -> None:
            if torch._C._current_graph_task_id() != -1:
                self.backward_calls[index] += 1

        return hook

    def _post(self, slot: int, kind: Event, index: int) -> Callable[..., None]:
        def hook(_mod: nn.Module, _args: Any, _kwargs: Any, out: Any) -> None:
            if self.track:
                self.outputs[slot].update(storages(out, self.params, out=True))
                self.edited_outputs[slot].update(
                    storages(
                        [t for t in output_leaves(out) if isinstance(t, torch.Tensor) and t._version > 0],
                        self.params,
                    )
                )
                edited = [t for t, v in self._arg_versions.pop(slot, []) if t._version != v]
                if edited:
                    self.edits_input[slot] = True
                    if kind is Event.FORWARD_END:
                        own = self._prev_out_args.pop(index, set())
                        self.edits_own_link[index] &= all(id(t) in own for t in edited)
            if self._active and self._active[-1] == slot:
                self._active.pop()
            self._settle(slot)
            if self.track and kind is Event.FORWARD_END:
                lazy = [
                    leaf
                    for leaf in output_leaves(out)
                    if isinstance(leaf, Iterator) and not isinstance(leaf, torch.Tensor)
                ]
                if lazy:
                    # A generator (or another iterator) holds its tensors where no pytree reaches them: the profile
                    # would count the block's output as 0 bytes, and plans recomputing it run over their budget.
                    raise RematError(
                        f"profile: block {self.block_names[index]!r} returns a {type(lazy[0]).__name__} (an iterator), "
                        "whose tensors remat cannot see without consuming it, so it cannot measure what the block's "
                        "output holds; return a tuple or a list instead"
                    )
            if kind is Event.FORWARD_END:
                if self.track:
                    # With the block's arguments (those of its first module, taken at its start).
                    self._held[index] = self._held.get(index, set()) | held_storages(
                        self.members[index], (_args, _kwargs)
                    )
                raw = self._raw_outs.pop(index, None)
                self._prev_outs = (
                    raw
                    if raw is not None
                    else [(weakref.ref(t), t._version) for t in output_leaves(out) if isinstance(t, torch.Tensor)]
                )
                # Their storages, read now: the tensors may be dead when the next block starts (``x = x.view(..)``
                # rebinding the only name of the output), their storages not (NOTE [ A view of a carried output ]).
                self._prev_out_storages = _storage_refs(
                    [r() for r, _ in self._prev_outs if r() is not None], self.params
                )
                if self.track:
                    self._seen.update(_storage_refs(out, self.params, out=True))
                for t in output_leaves(out):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        self.tensor_handles.append(t.register_hook(self._once(Event.BACKWARD, index)))
            elif kind is Event.SUB_END and self.track:
                for t in output_leaves(out):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        self.tensor_handles.append(t.register_hook(self._once(Event.SUB_BACKWARD, index)))
            self.callback(kind, index)

        return hook

    def _raw(self, index: int) -> Callable[..., None]:
        def hook(_mod: nn.Module, _args: Any, out: Any) -> None:
            tensors = [t for t in output_leaves(out) if isinstance(t, torch.Tensor)]
            self._raw_outs[index] = [(weakref.ref(t), t._version) for t in tensors]
            self.out_grad[index] = any(t.requires_grad for t in tensors)

        return hook

    def _link(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Block k's inputs are linked if each is one of block k-1's outputs, unchanged, or a tensor
        # whose storage existed before block k-1 started (a mask, rotary tables, a bias an earlier
        # block made): a segment across the boundary then holds nothing that is not held anyway.
        # NOTE [ Links are what the forward sees ]: the runtime links a member's argument to an earlier
        # member's output by identity and version, both as the forwards see them (NOTE [ Spans ] in
        # ``remat.core.runtime``), not as the module hooks do: a forward hook that returns a new tensor
        # (``o * 1.0``) or edits the output, or torch's wrapping of a module's arguments and outputs for
        # its full backward (pre-)hooks, makes the tensor the next member gets an external argument,
        # which a segment across the boundary holds (16 KiB per such boundary under-predicted, 1.3x the
        # budget on a split MLP, without this). So outputs are taken before the model's forward hooks
        # (``_raw``) and arguments the backward hooks wrap are never the previous block's outputs.
        # NOTE [ A view of a carried output ]: nor is a storage the previous block returned, taken through
        # another tensor (a view the code between makes), older though it is (its input, edited in place and
        # returned: a ReLU(inplace=True)); see the note after this method.
        ok = True
        if index:
            allowed = self._seen_before_prev | self._prev_inputs
            outs = {id(r()): v for r, v in self._prev_outs if r() is not None}
            handed = self._prev_out_storages
            wrapped = _wrapped_args(self.members[index][0], args)
            own = self._prev_out_args[index] = set()
            # Tensors in containers pytree does not open too (read as the block's inputs are): the recording holds
            # them for the segment's life, as any argument it does not link.
            for t in output_leaves((args, kwargs)):
                if not isinstance(t, torch.Tensor) or (
                    id(t) in outs and outs[id(t)] == t._version and id(t) not in wrapped
                ):
                    # Made in the previous block's call, not returned from its state (NOTE [ In-place edits of
                    # a member's output ] in remat.core.runtime).
                    if isinstance(t, torch.Tensor) and made_since(
                        t, self._marks.get(index - 1, sys.maxsize), self._held.get(index - 1)
                    ):
                        own.add(id(t))
                    continue
                try:
                    st = t.untyped_storage()
                    ptr = st.data_ptr()
                except (RuntimeError, NotImplementedError):
                    continue
                ref = allowed.get(ptr)
                older = ref is not None and ref() is st  # the same storage, not a new one at a freed address
                handed_ref = handed.get(ptr)
                if older and handed_ref is not None and handed_ref() is st:
                    older = False  # NOTE [ A view of a carried output ]
                if not older and ptr not in self.params:
                    ok = False
                    # NOTE [ An unlinked storage counted once ]
                    if ptr not in self._unlinked_storages[index]:
                        self.unlinked[index] += st.nbytes()
                        self._unlinked_storages[index][ptr] = st.nbytes()
        self.linked[index] = ok
        self._seen_before_prev = dict(self._seen)
        mine = _storage_refs((args, kwargs), self.params, out=True)
        self._prev_inputs = mine
        self._seen.update(mine)

    # NOTE [ An unlinked storage counted once ]
    # A block may take one storage through several arguments (``layer(x, ctx)`` where the model's code bound
    # ``ctx = x``, or two views of one tensor): the recording holds it once, and so does the plain step. Summed
    # per argument, ``unlinked_bytes`` counted it once per argument, and every segment through the block was
    # charged it again (a layer taking ``(x, x)`` after code made ``x``: one activation above the measured level
    # from that block to the segment's backward, full() at 0.94x its prediction). Each storage counts once, as
    # ``_unlinked_storages`` (by which ``unsaved_unlinked`` and the gap figures read them) always held it.

    # NOTE [ A view of a carried output ]
    # A storage that existed before the previous block started is held by a segment across the boundary
    # anyway when that segment starts at the previous block (its checkpoint holds the block's inputs). Not
    # when the previous block returned it (edited in place: ``nn.ReLU(inplace=True)``, the block
    # ``Chain.startable`` never lets a segment start at) and it was made inside the segment (by the block
    # before, a Linear): the runtime links an argument by identity (NOTE [ Spans ] in
    # ``remat.core.runtime``), and the code between the blocks handed the next block another tensor over that
    # storage (``bn(x.transpose(1, 2))``, ``x.view(...)``), so the recording holds it as an external argument
    # from the forward to the segment's backward, where the plain step, and a segment it links, drop it with
    # the recomputed blocks. Counted as linked, it was charged nowhere: fuzz seed 808's split blocks Linear,
    # ReLU(inplace=True), BatchNorm1d on the transposed output, under ``R[0:3](K0 K1 K2)``, measured 194760
    # bytes against a budget and prediction of 169984 (1.146x), the excess the Linear's output (24576 bytes;
    # helper-83, gc and the recording's ``_SaveInputs``). Such an argument is unlinked (``unlinked_bytes``,
    # which a segment going on through the block holds; on the safe side for a segment starting at the
    # previous block, which held it already), and the solvers do not join the blocks across it.

    def unsaved_unlinked(self, index: int) -> int:
        """Bytes of block ``index``'s unlinked inputs that its own forward does not save (tracked runs).

        The plain step may free them right after the block (``x = f(y)`` rebinding ``x``), while a
        segment starting at the block holds them as its inputs to its backward.
        """
        saved = self.saved[index]
        return sum(size for ptr, size in self._unlinked_storages[index].items() if ptr not in saved)

    def _buffer_pre(self, index: int) -> Callable[..., None]:
        def hook(_mod: nn.Module, _args: Any) -> None:
            snap: dict[str, tuple[torch.Tensor, int, bytes | torch.Tensor]] = {}
            for mod in self.members[index]:
                for name, buf in _plain_buffers(mod):
                    snap[f"{id(mod)}:{name}"] = (buf, buf._version, _buffer_copy(buf))
                # NOTE [ Parameters edited by the forward ]: by their version counters alone (no copy).
                for name, param in mod.named_parameters():
                    snap[f"parameter {id(mod)}:{name}"] = (param, param._version, b"")
            self._buffers_before[index] = snap

        return hook

    def _buffer_post(self, index: int) -> Callable[..., None]:
        def hook(_mod: nn.Module, _args: Any, _out: Any) -> None:
            snap = self._buffers_before.pop(index, {})
            names = {f"{id(mod)}:{name}": name for mod in self.members[index] for name, _ in _plain_buffers(mod)}
            names |= {
                f"parameter {id(mod)}:{name}": f"parameter {name}"
                for mod in self.members[index]
                for name, _ in mod.named_parameters()
            }
            changed = [
                names.get(key, key)
                for key, (buf, version, copy) in snap.items()
                if buf._version != version or (not key.startswith("parameter ") and not _same_as_copy(buf, copy))
            ]
            if changed:
                self.stateful[index] = tuple(changed)

        return hook

    # NOTE [ Parameters edited by the forward ]
    # A module may edit its own parameter in place in its forward: ``nn.Embedding(max_norm=...)``
    # renormalises the rows it looks up, an EMA codebook moves its centres. A replay would edit it again,
    # which the runtime refuses whatever ``allow_stateful`` says (``_check_params_kept`` in
    # remat.core.runtime): the profile itself failed on such a model, in its first checkpointed timing
    # iteration, with a message about ``apply``. Such a block is stateful ("parameter <name>"): the profile
    # keeps it in its checkpointed timing iterations and the plan keeps it. A version counter tells an
    # in-place edit (a ``.data`` assignment bumps none: the runtime's own check, by value, still refuses it).

    # NOTE [ Arguments changed by the call ]
    # A block may change a mutable argument it is called with (Gemma 3n's decoder layers add their keys
    # and values to a KVSharingDict that later layers read): a replay would run with the changed object
    # and change it again, which the runtime refuses (NOTE [ Arguments changed before the replay ] in
    # remat.core.runtime). Such a block is stateful: the profile keeps it in its checkpointed timing
    # iterations and the plan keeps it, instead of the whole profile failing on its replay.
    def _args_pre(self, index: int) -> Callable[..., None]:
        def hook(_mod: nn.Module, args: Any, kwargs: Any) -> None:
            from remat.core.runtime import _snapshot

            snaps = []
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    continue
                snap = _snapshot(leaf)
                if snap is not None:
                    snaps.append((leaf, snap))
            self._args_before[index] = snaps

        return hook

    def _args_post(self, index: int) -> Callable[..., None]:
        def hook(_mod: nn.Module, _args: Any, _out: Any) -> None:
            changed = [
                f"argument {type(leaf).__name__}"
                for leaf, snap in self._args_before.pop(index, [])
                if not snap.same(leaf)
            ]
            if changed:
                self.stateful[index] = tuple(dict.fromkeys((*self.stateful[index], *changed)))

        return hook

    def _pack(self, t: torch.Tensor) -> Any:
        # NOTE [ Saved outputs make cycles ]
        # A pack hook's return value is held by the graph node that saves it. When the saved tensor is
        # that node's own output (sigmoid, tanh, exp, a softmax save theirs), returning the tensor itself
        # makes a cycle (tensor -> its grad_fn -> the packed tensor) that passes through C++ and that
        # Python's collector does not see: a graph no backward runs through (a forward-only profile
        # run, a branch the loss does not reach) was never freed, and every remat.profile call kept
        # about three forwards' activations alive for good (448 MiB each on workload A), its op
        # timings running on freshly faulted memory (GELU 3x its time in a training step). A detached
        # alias holds the same storage without the grad_fn: the graph frees as without hooks, and the
        # node rebuilds the tensor's autograd links when it unpacks.
        if self._active:
            try:
                st = t.untyped_storage()
                ptr, size = st.data_ptr(), st.nbytes()
            except (RuntimeError, NotImplementedError):
                return t.detach()
            if ptr not in self.params and not autocast_cached(t, self._cast_mark):
                cast = autocast_cached(t, 1 << 62)
                held = t.detach()
                ref = weakref.ref(held)
                st_ref = weakref.ref(st)
                for slot in self._active:
                    self.saved[slot][ptr] = size
                    self._saves[slot].append((ptr, ref))
                    self._saved_storages[slot][ptr] = st_ref
                    if cast:
                        self.cast_saved[slot][ptr] = size
                return (held, tuple(self._active))
        return t.detach()

    # NOTE [ Saves of nodes that died in the forward ]
    # A node may save a tensor and die before the forward that made it returns: ``x.amax(-1).detach()``
    # (performer-pytorch's FAVOR+ feature maps: amax saves its input and its result, and the node goes with
    # the undetached result at once), an unused statistic, a dead branch. What it saved is held by nothing
    # (the input is freed after the next op), so checkpointing the module frees none of it. Counted as saved,
    # every plan checkpointing PerformerLM's attention sub-modules alone was predicted low by the two
    # feature maps and their maxima (180,256 B per sub-module; the smallest plan measured 1.053x its budget),
    # and identical layers' sub-module saved bytes differed where the allocator reused a dead save's address.
    # So a slot keeps, when its call returns, only the storages that a save still alive then holds (as
    # ``remat.profile.ops`` settles its per-op saves at the block's end); one saved earlier at an address
    # a live save reuses counts once, with the later size.
    # NOTE [ Inputs a block saves are storages, not addresses ]
    # Checkpointing a sub-module alone holds its inputs to its backward: free where its block saves them anyway,
    # a cost (SubProfile.held_inputs) where it does not. Compared by address, an input the block's forward frees
    # (``h = pad(x)`` taken by an nn.MultiheadAttention with batch_first, which works on transposed copies and
    # saves none of it) was taken for a saved one whenever the allocator handed its address to a tensor the
    # block saves later (``pad(o).sin()``): held_inputs lost it and saved_bytes counted it freed, so plans
    # checkpointing the sub-module were predicted that input low (K0 S1{layers.1.attn} K2: 1.045x its
    # prediction, S0{..} S1{..} K2 1.106x; fuzz_ext seed 22 in about one process of seven, heap-dependent:
    # 1.046x, and its 60% cell above its budget; helper-103). So an input counts as saved by its block only
    # where the same storage is alive in one of the block's saves when the block returns.
    def _settle(self, slot: int) -> None:
        saves, self._saves[slot] = self._saves[slot], []
        alive = {ptr for ptr, ref in saves if ref() is not None}
        for ptr in {ptr for ptr, _ in saves} - alive:
            self.saved[slot].pop(ptr, None)
            self.cast_saved[slot].pop(ptr, None)
        if slot < len(self.members):
            # NOTE [ Inputs a block saves are storages, not addresses ]
            held = self._saved_storages[slot]
            for sub, (block, refs) in self._sub_inputs.items():
                if block != slot:
                    continue
                for ptr, ref in refs.items():
                    st, saved_ref = ref(), held.get(ptr)
                    if st is not None and ptr in self.saved[slot] and saved_ref is not None and saved_ref() is st:
                        self.inputs_saved_by_block[sub].add(ptr)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple):
            t, slots = packed
            for slot in slots:
                self.unpacked[slot] = True
                if slot < len(self.members) and (Event.UNPACK, slot) not in self._fired:
                    self._fired.add((Event.UNPACK, slot))
                    self.callback(Event.UNPACK, slot)
            return t  # type: ignore[no-any-return]
        return packed  # type: ignore[no-any-return]

    def unreached(self, index: int) -> bool:
        """Whether block ``index`` saved tensors (other than parameters) of which the backward read none, or
        returned no tensor that requires a gradient (NOTE [ Blocks whose outputs need no gradient ])."""
        if self.saved[index]:
            return not self.unpacked[index]
        return not self.out_grad[index]

    # NOTE [ Blocks whose outputs need no gradient ]
    # A block whose parameters are frozen and whose inputs need no gradient (the backbone stages HF's
    # Conditional DETR freezes) saves nothing and returns tensors without a graph: no backward ever reaches it,
    # and a checkpoint over it holds nothing (the runtime records no call it could replay: no input, no RNG
    # state), as when it is kept. The chain model charged such a segment its input, an RNG state and the
    # late inputs it would hold: ``full()`` over Conditional DETR's six blocks was predicted 54,208 bytes above
    # its measured peak (0.933). Such a block is one the backward does not reach (``BlockProfile.backward``):
    # the planner keeps it, and a plan recomputing it is charged as if it kept it (``reached_ops``).

    @contextlib.contextmanager
    def installed(self) -> Iterator[Probe]:
        n = len(self.members)
        if self.track:
            # First of all forward hooks: the output as the forward returned it (NOTE [ Links are what
            # the forward sees ]).
            for i, mods in enumerate(self.members):
                self.handles.append(mods[-1].register_forward_hook(self._raw(i), prepend=True))
        for i, mods in enumerate(self.members):
            self.handles.append(mods[0].register_forward_pre_hook(self._pre(i, Event.FORWARD, i), with_kwargs=True))
            self.handles.append(mods[-1].register_forward_hook(self._post(i, Event.FORWARD_END, i), with_kwargs=True))
        if self.track:
            for i, mods in enumerate(self.members):
                # First of all pre-hooks: a hook may update state too (spectral norm's power iteration).
                self.handles.append(mods[0].register_forward_pre_hook(self._buffer_pre(i), prepend=True))
                self.handles.append(mods[-1].register_forward_hook(self._buffer_post(i)))
                self.handles.append(mods[0].register_forward_pre_hook(self._args_pre(i), with_kwargs=True))
                self.handles.append(mods[-1].register_forward_hook(self._args_post(i), always_call=True))
                # Any module of the block run inside the backward: the model recomputes the block itself
                # (HF's checkpointing calls the layer's forward past the layer's own hooks).
                for sub in {id(x): x for m in mods for x in m.modules()}.values():
                    self.handles.append(sub.register_forward_pre_hook(self._in_backward(i)))
        for j, sub in enumerate(self.subs):
            self.handles.append(sub.register_forward_pre_hook(self._pre(n + j, Event.SUB, j), with_kwargs=True))
            self.handles.append(sub.register_forward_hook(self._post(n + j, Event.SUB_END, j), with_kwargs=True))
            if self.track:
                # A sub-module that changes a mutable argument (the KV cache its attention appends to) cannot
                # be checkpointed alone; one that does not can, even in a block that does (its MLP).
                self.handles.append(sub.register_forward_pre_hook(self._args_pre(n + j), with_kwargs=True))
                self.handles.append(sub.register_forward_hook(self._args_post(n + j), always_call=True))
        ctx = (
            torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            if self.track
            else contextlib.nullcontext()
        )
        try:
            with ctx:
                yield self
        finally:
            self._prev_outs = []
            self._prev_out_storages = {}
            self._raw_outs.clear()
            self._arg_versions.clear()
            self._prev_out_args.clear()
            self._marks.clear()
            self._held.clear()
            self._buffers_before.clear()
            self._args_before.clear()
            for h in (*self.handles, *self.tensor_handles):
                h.remove()
            self.handles.clear()
            self.tensor_handles.clear()


@contextlib.contextmanager
def probe(model: nn.Module, block_list: Sequence[Block], callback: Callback, *, track: bool = False) -> Iterator[Probe]:
    """Report ``(event, index)`` at each block's forward start and end, backward start and end, and each
    attention/FFN sub-module's forward start and end (:class:`Event`); with ``track``, also record the
    storages each block saves for backward, takes and returns, and report when each sub-module's
    backward starts."""
    with Probe(model, block_list, callback, track=track).installed() as p:
        yield p
