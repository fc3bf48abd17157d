"""The tensors in what a block takes and returns: torch's pytree, with the user's dataclasses opened.

# NOTE [ Dataclasses are opened ]
remat finds the tensors a block takes and returns with ``torch.utils._pytree``, for which tuples,
lists, dicts, namedtuples and registered classes (HF's ``ModelOutput``) are containers and anything
else is one leaf. A block returning its hidden state in a dataclass of the user's own
(``Out(h, aux, n)``), or taking one, hid the tensor: the profile did not see the block's output, and
a segment could not link it to the next block's input, so each was held as a checkpoint input, and
plans measured 1.19-1.42x their budget with bitwise gradients (helper-46). Here an instance of a
dataclass that pytree does not know is opened into its fields (to a depth of ``_DEPTH`` dataclasses;
an instance passed twice is opened twice, one holding itself is a leaf inside itself): :func:`flatten`
gives its fields' leaves, and :func:`unflatten` of that spec rebuilds it, the same object when no field
changed, else a shallow copy with the fields replaced, one copy per instance (a replay calls a block
with a copy holding the replayed tensors). An instance opened only once held its second occurrence
(``layer(c, c)``) as one object with its tensors for the segment's life: 1.11x the budget. The spec holds the instance weakly and
a shell of it without its fields: a segment keeps the spec of each recorded call, and holding the
instance held the tensors in it (1.08x its budget). The global pytree registry is not touched: the
opened instances stand in a private node type. What a block returns is read with
:func:`output_leaves`, which opens plain objects holding tensors too (``return Out(h)``: a segment
linked nothing and plans measured 1.14-1.20x their budget); its arguments are not (a plain object may
not survive a copy: an HF cache, a handle), so a tensor a block takes inside one is held by the
recording as the object is (README, Known limits).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import threading
import types
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import (
    SUPPORTED_NODES,
    TreeSpec,
    register_pytree_node,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
)

__all__ = ["flatten", "leaves", "output_leaves", "unflatten"]

_DEPTH = 4


class _Opened:
    """Stands for one opened dataclass instance in a pytree: its fields are the children."""

    __slots__ = ("names", "obj", "values")

    def __init__(self, obj: Any, names: tuple[str, ...], values: list[Any]) -> None:
        self.obj, self.names, self.values = obj, names, values


def _context(node: _Opened) -> tuple[Any, Any, tuple[str, ...]]:
    # The spec outlives the call (a segment keeps it to rebuild the arguments of its replay): it holds the
    # instance weakly and a shell of it without its fields, never the tensors in them.
    try:
        ref: Any = weakref.ref(node.obj)
    except TypeError:  # a slotted dataclass without __weakref__
        ref = None
    shell = copy.copy(node.obj)
    for name in node.names:
        object.__setattr__(shell, name, None)
    return ref, shell, node.names


class _Memo(threading.local):
    # id of an instance's weak reference -> its copy, within one :func:`unflatten`: an instance passed twice
    # (``layer(c, c)``) is rebuilt as one copy, as the forward had one object (a block that sets a field of
    # one and reads the other sees its write).
    copies: dict[int, Any] | None = None


_MEMO = _Memo()


def _rebuild(values: Any, context: Any) -> Any:
    ref, shell, names = context
    values = list(values)
    obj = ref() if ref is not None else None
    if obj is not None and all(getattr(obj, name, _MISSING) is value for name, value in zip(names, values)):
        return obj
    copies = _MEMO.copies
    if copies is not None and ref is not None and id(ref) in copies:
        return copies[id(ref)]
    new = copy.copy(shell)
    for name, value in zip(names, values):
        object.__setattr__(new, name, value)  # frozen dataclasses too
    if copies is not None and ref is not None:
        copies[id(ref)] = new
    return new


_MISSING = object()
register_pytree_node(
    _Opened,
    lambda node: (node.values, _context(node)),
    _rebuild,
    serialized_type_name="remat.core.tree._Opened",
)


def _closed(leaf: Any) -> bool:
    """Whether ``leaf`` is a dataclass instance that pytree takes as one leaf."""
    return dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and type(leaf) not in SUPPORTED_NODES


def _has_dict(leaf: Any) -> bool:
    """``hasattr(leaf, "__dict__")``, False where the lookup raises something else (a ``__getattr__`` of a
    ``__slots__`` class that raises KeyError or recurses): a user's object is never a reason to fail."""
    try:
        return hasattr(leaf, "__dict__")
    except Exception:
        return False


def _plain(leaf: Any) -> bool:
    """Whether ``leaf`` is an object of a plain class, with attributes of its own, that pytree takes as one leaf."""
    return (
        _has_dict(leaf)
        and not isinstance(
            leaf, (torch.Tensor, nn.Module, type, types.FunctionType, types.MethodType, types.ModuleType)
        )
        and type(leaf) not in SUPPORTED_NODES
        and not callable(leaf)
    )


def _names(leaf: Any, objects: bool) -> tuple[str, ...] | None:
    if _closed(leaf):
        fields = [f.name for f in dataclasses.fields(leaf) if hasattr(leaf, f.name)]
        # Attributes that are no fields (set in ``__post_init__``, or later) are opened too: left in the shell,
        # a tensor in one was held by every recorded call and, edited in place before the backward, reached
        # the replay unchecked (an object leaf is snapshotted; an opened one is not).
        fields += [name for name in getattr(leaf, "__dict__", ()) if name not in fields]
        return tuple(fields)
    if objects and _plain(leaf):
        names = tuple(vars(leaf))
        if any(isinstance(t, torch.Tensor) for name in names for t in tree_leaves(getattr(leaf, name))):
            return names
    return None


def _contents(leaf: Any) -> Any:
    """What an object that pytree takes as one leaf holds, as plain containers, for reading what a block
    returns (never rebuilt): a tuple, list or dict subclass pytree does not know, an object with ``__slots__``
    and no ``__dict__``, a ``functools.partial``, a function's closure; ``_MISSING`` for anything else.
    Left closed, the tensors in them were invisible: the profile counted such an output as 0 bytes and its
    segments linked nothing (plans 1.08-1.16x their budget)."""
    if isinstance(leaf, (torch.Tensor, nn.Module, type)) or type(leaf) in SUPPORTED_NODES or _closed(leaf):
        return _MISSING
    if isinstance(leaf, (tuple, list)):
        return list(leaf)
    if isinstance(leaf, dict):
        return dict(leaf)
    if isinstance(leaf, functools.partial):
        return [leaf.args, dict(leaf.keywords)]
    if isinstance(leaf, types.FunctionType):
        cells = []
        for cell in leaf.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        return cells if cells else _MISSING
    if not _has_dict(leaf):
        names = []
        for cls in type(leaf).__mro__:
            slots = getattr(cls, "__slots__", ())
            names += [slots] if isinstance(slots, str) else [n for n in slots if isinstance(n, str)]
        values = {}
        for n in names:
            if n == "__weakref__":
                continue
            try:
                values[n] = getattr(leaf, n)
            except Exception:  # an empty slot (AttributeError), or a __getattr__ that raises something else
                continue
        return values if values else _MISSING
    return _MISSING


def _open(tree: Any, depth: int, inside: set[int], objects: bool) -> Any:
    # ``inside``: the instances being opened around this point (an instance holding itself is a leaf there);
    # one that appears twice elsewhere is opened twice, and rebuilt once (_MEMO).
    def one(leaf: Any) -> Any:
        if depth >= _DEPTH or id(leaf) in inside or isinstance(leaf, torch.Tensor):
            return leaf
        if objects:
            inner = _contents(leaf)
            if inner is not _MISSING:
                inside.add(id(leaf))
                try:
                    return _open(inner, depth + 1, inside, objects)
                finally:
                    inside.discard(id(leaf))
        names = _names(leaf, objects)
        if names is None:
            return leaf
        inside.add(id(leaf))
        try:
            return _Opened(leaf, names, [_open(getattr(leaf, name), depth + 1, inside, objects) for name in names])
        finally:
            inside.discard(id(leaf))

    return tree_map(one, tree)


# NOTE [ Plain calls ]
# Nearly every call remat records is ``block(t1, ..., tn)``: tensors by position, no keyword. pytree's
# flatten and unflatten of ``(args, kwargs)`` cost about 20 us each per call in Python; for such a call
# the leaves are the arguments and the spec depends on ``n`` only, made once by pytree itself and then
# shared (a TreeSpec is immutable), and unflattening it is ``(tuple(leaves), {})``.
_PLAIN_SPECS: dict[int, TreeSpec] = {}
_TENSORS = (torch.Tensor, nn.Parameter)


def _plain_call(tree: Any) -> bool:
    return (
        type(tree) is tuple
        and len(tree) == 2
        and type(tree[0]) is tuple
        and type(tree[1]) is dict
        and not tree[1]
        and all(type(a) in _TENSORS for a in tree[0])
    )


def flatten(tree: Any) -> tuple[list[Any], TreeSpec]:
    """``tree_flatten`` with the dataclasses pytree does not know opened (NOTE [ Dataclasses are opened ]);
    ``torch.utils._pytree.tree_unflatten`` of the spec rebuilds them."""
    if _plain_call(tree):  # NOTE [ Plain calls ]
        n = len(tree[0])
        spec = _PLAIN_SPECS.get(n)
        if spec is None:
            spec = _PLAIN_SPECS[n] = tree_flatten((tuple(range(n)), {}))[1]
        return list(tree[0]), spec
    flat, spec = tree_flatten(tree)
    if not any(_closed(leaf) for leaf in flat):
        return flat, spec
    return tree_flatten(_open(tree, 0, set(), False))


def unflatten(values: list[Any], spec: TreeSpec) -> Any:
    """``tree_unflatten``, rebuilding an opened instance that appears twice as one copy."""
    if spec is _PLAIN_SPECS.get(len(values)):  # NOTE [ Plain calls ]
        return tuple(values), {}
    previous = _MEMO.copies
    _MEMO.copies = {}
    try:
        return tree_unflatten(values, spec)
    finally:
        _MEMO.copies = previous


def leaves(tree: Any) -> list[Any]:
    """The leaves of :func:`flatten`."""
    return flatten(tree)[0]


def output_leaves(tree: Any) -> list[Any]:
    """The leaves of what a block returns: :func:`leaves`, and the attributes of plain objects holding
    tensors opened too (``return Out(h)`` of a class of the user's own; read only, never rebuilt)."""
    flat = tree_leaves(tree)
    if not any(_closed(leaf) or _plain(leaf) or _contents(leaf) is not _MISSING for leaf in flat):
        return flat
    return tree_leaves(_open(tree, 0, set(), True))
