"""Every classic checkpointing rule from the reference documents, each a small validated frozen dataclass.

A strategy is anything with the :class:`Strategy` protocol: a ``name`` (its key in :data:`STRATEGIES`),
a ``label`` (name and parameters, the ``strategy`` of the plans it makes), whether it ``needs_profile``
(reads measured sizes: ``largest``, ``budget``, ``dynamic``), and one method, ``ops``, that turns a
:class:`Target` (the blocks, and their profile where there is one) into plan operations. The rules share
helpers, not a base class. ``remat.plan(source, strategy=...)`` turns a strategy into a :class:`Plan`.

NOTE [ Strategies and in-place blocks ]: a block that edits its tensor argument in place (a split
``nn.ReLU(inplace=True)``, ``nn.SiLU(inplace=True)``, an in-place dropout) cannot be recomputed alone or at
a segment's start: its replay would edit its input again, and ``apply`` refuses it on the first step.
The rules that choose blocks themselves (``full``, ``every_nth``, ``dynamic``, ``ratio``, ``largest``,
``budget``, ``segments``, ``sqrt``) therefore put such a block in the segment of the block before it
when that block is recomputed in a segment ending there (as the planner does: ``full()`` on Linear,
ReLU(inplace=True) checkpoints them together, ``R[0:2]``; ``sqrt()`` moves a cut from before it to after
it), and keep it otherwise (recomputed alone it would hold nothing less: it returns its input); a block
that edits another tensor than the previous block's output is kept, its segment cut around it. What edits
in place is read from the profile (``BlockProfile.edits_input`` / ``edits_own_link``), or without one from
the model (:func:`inplace_blocks`: a block whose first member is a torch module built with
``inplace=True``); on bare blocks nothing tells, and ``apply`` refuses such a plan up front. ``selective``
and ``named``, whose blocks you choose, refuse such a block instead of changing your choice.
"""

from __future__ import annotations

import ast
import difflib
import functools
import inspect
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, runtime_checkable

from torch import nn

from remat.blocks import Block, LayerType
from remat.core.ops import Keep, Op, Recompute, RecomputeSub
from remat.errors import RematError
from remat.plan.types import single_level_ops
from remat.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from remat.profile.types import Profile

log = logging.getLogger(__name__)

__all__ = [
    "Strategy",
    "Target",
    "STRATEGIES",
    "KeepAll",
    "Full",
    "EveryNth",
    "Selective",
    "Dynamic",
    "Ratio",
    "ByKind",
    "Largest",
    "GreedyBudget",
    "Segments",
    "Sqrt",
    "Named",
    "none",
    "full",
    "every_nth",
    "selective",
    "dynamic",
    "ratio",
    "attention_only",
    "ffn_only",
    "largest",
    "budget",
    "segments",
    "sqrt",
    "named",
    "parse_strategy",
    "strategy_params",
    "bench_strategies",
    "inplace_blocks",
]


@dataclass(frozen=True)
class Target:
    """What a strategy plans over: the blocks, and their measured profile where there is one.

    Attributes:
        blocks: The blocks, in forward order.
        profile: Their profile (``remat.profile``); ``None``: only strategies that read no sizes can plan.
        inplace: Without a profile, whether each block starts with a torch module that edits its input in
            place (:func:`inplace_blocks`); ``None``: unknown (NOTE [ Strategies and in-place blocks ]).
    """

    blocks: tuple[Block, ...]
    profile: Profile | None = None
    inplace: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if self.inplace is not None:
            object.__setattr__(self, "inplace", tuple(self.inplace))

    def edits(self) -> tuple[str, ...]:
        """How each block edits its tensor arguments in place (NOTE [ Strategies and in-place blocks ]).

        ``""``: not at all (or unknown: no profile and no ``inplace``); ``"link"``: only the previous
        block's output, so it may be recomputed in a segment that starts before it; ``"keep"``: something
        else (the model's input, an older tensor), so it is never recomputed.
        """
        n = len(self.blocks)
        if self.profile is not None and len(self.profile.block_profiles) == n:
            return tuple(
                "" if not bp.edits_input else "link" if bp.edits_own_link and i else "keep"
                for i, bp in enumerate(self.profile.block_profiles)
            )
        if self.inplace is not None and len(self.inplace) == n:
            return tuple("" if not e else "link" if i else "keep" for i, e in enumerate(self.inplace))
        return ("",) * n

    def sizes(self, strategy: str) -> Profile:
        """The profile, for a strategy that reads measured sizes.

        Args:
            strategy: The strategy's name, for the message.

        Raises:
            RematError: If there is no profile, or it is of a different number of blocks.
        """
        if self.profile is None:
            raise RematError(
                f"strategy {strategy}: needs measured block sizes; pass profile=remat.profile(model, inputs, loss_fn)"
            )
        n = len(self.blocks)
        if len(self.profile.block_profiles) != n:
            raise RematError(
                f"strategy {strategy}: the profile has {len(self.profile.block_profiles)} blocks but the model has "
                f"{n}; profile the same blocks you apply to"
            )
        return self.profile


@runtime_checkable
class Strategy(Protocol):
    """A rule that chooses what to recompute: the protocol every registered strategy follows."""

    @property
    def name(self) -> str:
        """Its key in :data:`STRATEGIES`, e.g. ``"every_nth"``."""

    @property
    def label(self) -> str:
        """Name and parameters, e.g. ``"every_nth(n=2)"``: the ``strategy`` of the plans it makes."""

    @property
    def needs_profile(self) -> bool:
        """Whether :meth:`ops` reads measured sizes (``Target.profile``)."""

    def ops(self, target: Target) -> tuple[Op, ...]:
        """The plan operations over ``target.blocks``, in order, each block covered once.

        Raises:
            RematError: If the strategy does not fit the blocks, or needs sizes the target lacks.
        """


# ----------------------------------------------------------------------------------------------------
# Shared helpers


def _short(v: Any) -> str:
    if isinstance(v, tuple) and len(v) > 6:
        return f"({', '.join(map(str, v[:6]))}, ...)"
    return repr(v) if isinstance(v, str) else str(v)


def _label(name: str, **params: Any) -> str:
    args = ", ".join(f"{k}={_short(v)}" for k, v in params.items())
    return f"{name}({args})" if args else name


def _check_int(strategy: str, param: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RematError(f"strategy {strategy}: {param}={value!r} is invalid; it must be an integer >= {low}")


def _check_fraction(strategy: str, param: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise RematError(f"strategy {strategy}: {param}={value!r} is outside [0, 1]; give a fraction such as 0.5")


def _each(target: Target, chosen: Iterable[int], *, strategy: str | None = None) -> tuple[Op, ...]:
    """Each chosen block under its own checkpoint, the others kept, fitted to in-place blocks (:func:`_fit`);
    ``strategy``: refuse a chosen block that edits in place instead, naming the strategy."""
    chosen = frozenset(chosen)
    if strategy is not None:
        edits = target.edits()
        bad = sorted(i for i in chosen if i < len(edits) and edits[i])
        if bad:
            b = target.blocks[bad[0]]
            raise RematError(
                f"strategy {strategy}: block {bad[0]} ({b.name}, {b.class_name}) edits its tensor argument in place, "
                "so recomputing it alone would edit it again (apply refuses it); leave it out of the blocks you "
                "checkpoint, or use full() / segments(k), which recompute it with the block before it"
            )
    return _fit(target, single_level_ops(len(target.blocks), chosen))


def _fit(target: Target, ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """``ops`` with no segment starting at, nor holding, a block that may not be recomputed there.

    A block that edits the previous block's output in place (``"link"``) joins the segment ending just
    before it, else is kept; one that edits anything else (``"keep"``) is kept, its segment cut around
    it (NOTE [ Strategies and in-place blocks ]). Only flat segments (of kept blocks) are changed.
    """
    edits = target.edits()
    if not any(edits):
        return ops
    out: list[Op] = []

    def close(piece: list[int]) -> None:
        while piece and edits[piece[0]] == "link":
            last = out[-1] if out else None
            if isinstance(last, Recompute) and last.stop == piece[0] and all(isinstance(o, Keep) for o in last.inner):
                out[-1] = Recompute(last.start, piece[0] + 1, (*last.inner, Keep(piece[0])))
            else:
                out.append(Keep(piece[0]))
            piece.pop(0)
        if piece:
            out.append(Recompute(piece[0], piece[-1] + 1, tuple(Keep(i) for i in piece)))

    for op in ops:
        if not isinstance(op, Recompute) or not all(isinstance(o, Keep) for o in op.inner):
            out.append(op)
            continue
        piece: list[int] = []
        for i in range(op.start, op.stop):
            if edits[i] == "keep":
                close(piece)
                piece = []
                out.append(Keep(i))
            else:
                piece.append(i)
        close(piece)
    if out != list(ops):
        log.info("strategy: in-place blocks moved into the segment before them or kept: %s -> %s", ops, tuple(out))
    return tuple(out)


# Torch modules that edit their input in place when built with inplace=True (dropouts only in training, p > 0).
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def inplace_blocks(model: nn.Module, blocks: Sequence[Block]) -> tuple[bool, ...]:
    """Whether each block's first member is a ``torch.nn`` module that edits its input in place: built with
    ``inplace=True`` (``nn.ReLU``, ``nn.SiLU``, ``nn.Hardtanh`` ..., a dropout with ``p > 0`` in training mode).

    What a strategy knows of in-place blocks without a profile (NOTE [ Strategies and in-place blocks ]);
    a module of your own that edits its input is found by ``remat.profile`` only (``apply`` refuses it).
    Blocks not in ``model`` count as not editing (``apply`` reports them).
    """
    out = []
    for b in blocks:
        try:
            m = model.get_submodule(b.fqns[0])
        except AttributeError:
            out.append(False)
            continue
        out.append(
            getattr(m, "inplace", False) is True
            and type(m).__module__.startswith("torch.nn.modules.")
            and (not isinstance(m, _DROPOUTS) or (m.training and m.p > 0))
        )
    return tuple(out)


def _segment_bounds(n: int, k: int) -> list[tuple[int, int]]:
    size, extra = divmod(n, k)
    bounds, start = [], 0
    for i in range(k):
        stop = start + size + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _segment_ops(target: Target, k: int) -> tuple[Op, ...]:
    # As torch.utils.checkpoint.checkpoint_sequential: every segment but the last is checkpointed; a
    # segment never starts at an in-place block (_fit: its cut moves after it).
    ops: list[Op] = []
    bounds = _segment_bounds(len(target.blocks), k)
    for j, (a, b) in enumerate(bounds):
        keeps = tuple(Keep(i) for i in range(a, b))
        ops.extend(keeps if j == len(bounds) - 1 else (Recompute(a, b, keeps),))
    return _fit(target, tuple(ops))


def _retained(profile: Profile, chosen: frozenset[int]) -> int:
    # Bytes held after the forward when `chosen` blocks are checkpointed one by one (measured sizes).
    return sum(bp.output_bytes if i in chosen else bp.keep_bytes for i, bp in enumerate(profile.block_profiles))


# ----------------------------------------------------------------------------------------------------
# The strategies


@dataclass(frozen=True)
class KeepAll:
    """``none``: keep every block, the baseline."""

    name: ClassVar[str] = "none"
    needs_profile: ClassVar[bool] = False

    @property
    def label(self) -> str:
        """See :attr:`Strategy.label`."""
        return _label(self.name)

    def summary(self) -> str:
        """The rule in one line."""
        return f"{self.label}: keep every block (no checkpointing)"

    def ops(self, target: Target) -> tuple[Op, ...]:
        """See :meth:`Strategy.ops`."""
        return _each(target, ())


@dataclass(frozen=True)
class Full:
    """``full``: checkpoint every block; a block that edits the previous block's output in place (a split
    ``nn.ReLU(inplace=True)``) is checkpointed with it, in one segment (NOTE [ Strategies and in-place blocks ])."""

    name: ClassVar[str] = "full"
    needs_profile: ClassVar[bool] = False

    @property
    def label(self) -> str:
        """See :attr:`Strategy.label`."""
        return _label(self.name)

    def summary(self) -> str:
        """The rule in one line."""
        return f"{self.label}: checkpoint every block"

    def ops(self, target: Target) -> tuple[Op, ...]:
        """See :meth:`Strategy.ops`."""
        return _each(target, range(len(target.blocks)))


@dataclass(frozen=True)
class EveryNth:
    """``every_nth``: checkpoint blocks 0, n, 2n, ...; one of them that edits its input in place is kept
    (recomputed alone it would edit it again; NOTE [ Strategies and in-place blocks ]).

    Attributes:
        n: The interval, >= 1.
    """

    n: int
    name: ClassVar[str] = "every_nth"
    needs_profile: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_int(self.name, "n", self.n, 1)

    @property
    def label(self) -> str:
        """See :attr:`Strategy.label`."""
        return _label(self.name, n=self.n)

    def summary(self) -> str:
        """The rule in one line."""
        return f"{self.label}: checkpoint blocks 0, {self.n}, {2 * self.n}, ... (uniform interval)"

    def ops(self, target: Target) -> tuple[Op, ...]:
        """See :meth:`Strategy.ops`."""
        return _each(target, range(0, len(target.blocks), self.n))


@dataclass(frozen=True)
class Selective:
    """``selective``: checkpoint the listed blocks.

    Attributes:
        indices: Block indices, each >= 0 and listed once.
    """

    indices: tuple[int, ...]
    name: ClassVar[str] = "selective"
    needs_profile: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if isinstance(self.indices, (int, str)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in self.indices
        ):
            raise RematError(f"strategy selective: indices={self.indices!r} must be a sequence of block indices (ints)")
        object.__setattr__(self, "indices", tuple(self.indices))
        negative = [i for i in self.indices if i < 0]
        if negative:
            raise RematError(f"strategy selective: indices {negative} are negative; block indices start at 0")
        dupes = sorted({i for i in self.indices if self.indices.count(i) > 1})
        if dupes:
            raise RematError(f"strategy selective: duplicate indices {dupes}; list each block once")

    @property
    def label(self) -> str:
        """See :attr:`Strategy.label`."""
        return _label(self.name, indices=self.indices)

    def summary(self) -> str:
        """The rule in one line."""
        return f"{self.label}: checkpoint blocks {list(self.indices)}"

    def ops(self, target: Target) -> tuple[Op, ...]:
        """See :meth:`Strategy.ops`."""
        n = len(target.blocks)
        beyond = [i for i in self.indices if i >= n]
        if beyond:
            raise RematError(f"strategy selective: indices {beyond} are out of range for {n} blocks (valid 0..{n - 1})")
        return _each(target, self.indices, strategy=self.name)


@dataclass(frozen=True)
class Dynamic:
    """``dynamic``: every k-th block, k as large as keeps the measured activations within a share.

    Attributes:
        memory_fraction: Target share of the activations kept with no checkpointing, in [0, 1].
        min_interval: The smallest interval allowed, >= 1.
    """

    memory_fraction: float
    min_interval: int = 1
    name: ClassVar[str] = "dynamic"
    needs_profile: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_fraction(self.name, "memory_fraction", self.memory_fraction)
        _check_int(self.name, "min_interval", self.min_interval, 1)

    @property
    def label(self) -> str:
        """See :attr:`Strategy.label`."""
        return _label(self.name, memory_fraction=self.memory_fraction, min_interval=self.min_interval)

    def summary(self) -> str:
        """The rule in one line."""
        return (
            f"{self.label}: checkpoint every k-th block, k the largest interval (>= {self.min_interval}) keeping "
            f"the measured activations within {self.memory_fraction:.0%} of keeping everything"
        )

    def interval(self, target: Target) -> int | None:
        """The largest checkpoint interval whose measured retained bytes meet the target (``None``: keep all)."""
        prof = target.sizes(self.name)
        n = len(target.blocks)
        target_bytes = self.memory_fraction * _retained(prof, frozenset())
        if _retained(prof, frozenset()) <= target_bytes:
            return None
        for k in range(max(n, self.min_interval), self.min_interval - 1, -1):
            if _retained(prof, frozenset(range(0, n, k))) <= target_bytes:
                return k
        log.warning(
            "strategy dynamic: no interval >= %d keeps the activations within %.0f%%; using interval %d",
            self.min_interval,
            self.memory_fraction * 100,
            self.min_interval,
        )
        return self.min_interval

    def ops(self, target: Target) -> tuple[Op, ...]:
        """See :meth:`Strategy.ops`."""
        k = self.interval(target)
        return _each(target, () if k is None else range(0, len(target.blocks), k))


@dataclass(frozen=True)
class Ratio:
    """``ratio``: checkpoint a share of the blocks, evenly spread (the seed's ``Selective(checkpoint_ratio)``).

    Attributes:
        checkpoint_ratio: Share of blocks to checkpoint, in [0, 1].
    """

    checkpoint_ratio: float
    name: ClassVar[str] = "ratio"
    needs_profile: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_fraction(self.name, "checkpoint_ratio", self.checkpoint_ratio)

    @property
    def label(self) -> str:
        """See :attr:`Strategy.label`."""
        return _label(self.name, checkpoint_ratio=self.checkpoint_ratio)

    def summary(self) -> str:
        """The rule in one line."""
        return f"{self.label}: checkpoint {self.checkpoint_ratio:.0%} of the blocks, evenly spread"

    def ops(self, target: Target) -> tuple[Op, ...]:
        """See :meth:`Strategy.ops`."""
        n = len(target.blocks)
        count = round(self.checkpoint_ratio * n)
        if count == 0:
            return _each(target, ())
        step = max(1, round(n / count))
        return _each(target, tuple(range(0, n, step))[:count])


class _Kind(NamedTuple):
    name: str  # the registry name of ByKind for this kind
    what: str  # in messages
    words: str  # in the summary


_KINDS: dict[LayerType, _Kind] = {
    LayerType.ATTENTION: _Kind(
        "attention_only", "attention", "attention (whole attention blocks, or the attention inside mixed blocks)"
    ),
    LayerType.FFN: _Kind(
        "ffn_only", "feed-forward (MLP)", "feed-forward (whole FFN blocks, or the FFN inside mixed blocks)"
    ),
}


def _subs(block: Block, kind: LayerType) -> tuple[str, ...]:
    return block.attention_fqns if kind is LayerType.ATTENTION else block.ffn_fqns


@dataclass(frozen=True)
class ByKind:
    """``attention_only`` / ``ffn_only``: blocks of one kind wholly, that kind's sub-module inside mixed blocks.

    Attributes:
        kind: ``LayerType.ATTENTION`` or ``LayerType.FFN``.
        min_interval: Only blocks whose index is a multiple of this, >= 1.
    """

    kind: LayerType
    min_interval: int = 1
    needs_profile: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise RematError(
                f"strategy ByKind: kind={self.kind!r} has no strategy; use one of "
                f"{', '.join(f'LayerType.{k.name}' for k in _KINDS)}"
            )
        _check_int(self.name, "min_interval", self.min_interval, 1)

    @property
    def name(self) -> str:
        """``"attention_only"`` or ``"ffn_only"``."""
        return _KINDS[self.kind].name

    @property
    def label(self) -> str:
        """See :attr:`Strategy.label`."""
        return _label(self.name, min_interval=self.min_interval)

    def summary(self) -> str:
        """The rule in one line."""
        return f"{self.label}: checkpoint {_KINDS[self.kind].words}, every {self.min_interval}"

    def ops(self, target: Target) -> tuple[Op, ...]:
        """See :meth:`Strategy.ops`."""
        blocks = target.blocks
        ops: list[Op] = []
        for i, b in enumerate(blocks):
            if i % self.min_interval != 0:
                ops.append(Keep(i))
            elif b.type_hint is self.kind:
                ops.append(Recompute(i, i + 1, (Keep(i),)))
            elif _subs(b, self.kind):
                ops.append(RecomputeSub(i, _subs(b, self.kind)))
            else:
                ops.append(Keep(i))
        if not any(b.type_hint is self.kind or _subs(b, self.kind) for b in blocks):
            raise RematError(
                f"strategy {self.name}: found no {_KINDS[self.kind].what} block or sub-module in the {len(blocks)} "
                f"blocks ({blocks[0].name if blocks else '-'}..{blocks[-1].name if blocks else '-'}), so it would "
                "checkpoint nothing; use another strategy (full(), remat.plan(profile, budget)) or choose the "
                "blocks yourself"
            )
        return tuple(ops)


@dataclass(frozen=True)
class Largest:
    """``largest``: checkpoint the ``top_k`` blocks that save the most bytes for backward (measured).

    Attributes:
        top_k: How many blocks, >= 0.
    """

    top_k: int
    name: ClassVar[str] = "largest"
    needs_profile: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_int(self.name, "top_k", self.top_k, 0)

    @property
    def label(self) -> str:
        """See :attr:`Strategy.label`."""
        return _label(self.name, top_k=self.top_k)

    def summary(self) -> str:
        """The rule in one line."""
        return f"{self.label}: checkpoint the {self.top_k} blocks that save the most bytes for backward (measured)"

    def ops(self, target: Target) -> tuple[Op, ...]:
        """See :meth:`Strategy.ops`."""
        prof = target.sizes(self.name)
        n = len(target.blocks)
        if self.top_k > n:
            raise RematError(f"strategy largest: top_k={self.top_k} exceeds the {n} blocks; use 0..{n}")
        order = sorted(range(n), key=lambda i: (-prof.block_profiles[i].saved_bytes, i))
        return _each(target, order[: self.top_k])


@dataclass(frozen=True)
class GreedyBudget:
    """``budget``: the seed's greedy, by saved bytes per recompute ms until the saved bytes fit.

    Attributes:
        max_bytes: Saved activations allowed, bytes (or a size such as ``"200MiB"``, parsed), >= 0.
    """

    max_bytes: int
    name: ClassVar[str] = "budget"
    needs_profile: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, (int, float)) and not isinstance(self.max_bytes, bool) and self.max_bytes < 0:
            raise RematError(
                f"strategy budget: max_bytes={self.max_bytes!r} is negative; give bytes >= 0 or a size like '200MiB'"
            )
        object.__setattr__(self, "max_bytes", parse_bytes(self.max_bytes))

    @property
    def label(self) -> str:
        """See :attr:`Strategy.label`."""
        return _label(self.name, max_bytes=self.max_bytes)

    def summary(self) -> str:
        """The rule in one line."""
        return (
            f"{self.label}: greedily checkpoint blocks by saved bytes per recompute ms until saved activations "
            f"<= {format_bytes(self.max_bytes)}"
        )

    def ops(self, target: Target) -> tuple[Op, ...]:
        """See :meth:`Strategy.ops`."""
        prof = target.sizes(self.name)
        saved = [bp.saved_bytes for bp in prof.block_profiles]
        remaining = sum(saved)
        chosen: set[int] = set()
        # The seed's greedy: most bytes saved per unit of recompute cost first (measured forward time).
        order = sorted(range(len(saved)), key=lambda i: (-saved[i] / (prof.block_profiles[i].fwd_ms + 1e-3), i))
        for i in order:
            if remaining <= self.max_bytes:
                break
            chosen.add(i)
            remaining -= saved[i]
        return _each(target, chosen)


@dataclass(frozen=True)
class Segments:
    """``segments``: cut the blocks into ``k`` even segments and checkpoint all but the last; a cut before a
    block that edits its input in place moves after it (NOTE [ Strategies and in-place blocks ]).

    Attributes:
        k: Number of segments, >= 1.
    """

    k: int
    name: ClassVar[str] = "segments"
    needs_profile: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_int(self.name, "k", self.k, 1)

    @property
    def label(self) -> str:
        """See :attr:`Strategy.label`."""
        return _label(self.name, k=self.k)

    def summary(self) -> str:
        """The rule in one line."""
        return f"{self.label}: cut the blocks into {self.k} even segments; checkpoint all but the last (checkpoint_sequential)"

    def ops(self, target: Target) -> tuple[Op, ...]:
        """See :meth:`Strategy.ops`."""
        n = len(target.blocks)
        if self.k > n:
            raise RematError(f"strategy segments: k={self.k} exceeds the {n} blocks; use 1..{n}")
        return _segment_ops(target, self.k)


@dataclass(frozen=True)
class Sqrt:
    """``sqrt``: ``segments(round(sqrt(n)))``, the classic O(sqrt n) memory schedule (in-place blocks as
    in :class:`Segments`)."""

    name: ClassVar[str] = "sqrt"
    needs_profile: ClassVar[bool] = False

    @property
    def label(self) -> str:
        """See :attr:`Strategy.label`."""
        return _label(self.name)

    def summary(self) -> str:
        """The rule in one line."""
        return f"{self.label}: cut the blocks into round(sqrt(n)) segments; checkpoint all but the last"

    def ops(self, target: Target) -> tuple[Op, ...]:
        """See :meth:`Strategy.ops`."""
        n = len(target.blocks)
        return _segment_ops(target, max(1, round(math.sqrt(n)))) if n else ()


@dataclass(frozen=True)
class Named:
    """``named``: checkpoint named blocks (NNTrainer's ``addCheckpointBlock``), each group's inside recomputed.

    Its blocks are the groups themselves: ``remat.plan(model, strategy=...)`` finds them in the model
    (``remat.blocks(model, named=groups)``).

    Attributes:
        groups: Lists of consecutive sibling module FQNs; each list is one block.
    """

    groups: tuple[tuple[str, ...], ...]
    name: ClassVar[str] = "named"
    needs_profile: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if isinstance(self.groups, str) or not self.groups:
            raise RematError(
                f"strategy named: groups={self.groups!r} must be a non-empty list of lists of module names"
            )
        object.__setattr__(self, "groups", tuple((g,) if isinstance(g, str) else tuple(g) for g in self.groups))

    @property
    def label(self) -> str:
        """See :attr:`Strategy.label`."""
        return _label(self.name, groups=self.groups)

    def summary(self) -> str:
        """The rule in one line."""
        return (
            f"{self.label}: checkpoint the named blocks {[list(g) for g in self.groups]} (inputs and outputs kept, "
            "inside recomputed)"
        )

    def ops(self, target: Target) -> tuple[Op, ...]:
        """See :meth:`Strategy.ops`."""
        blocks = target.blocks
        have = {b.fqns for b in blocks}
        missing = [list(g) for g in self.groups if g not in have]
        if missing:
            raise RematError(
                f"strategy named: {missing} are not blocks here (blocks are {[b.name for b in blocks][:4]}...); "
                "apply it to the model (remat.apply(model, remat.named(...))) or profile with "
                "blocks=remat.blocks(model, named=...)"
            )
        return _each(target, (i for i, b in enumerate(blocks) if b.fqns in set(self.groups)), strategy=self.name)


# NOTE [ Strategy registry ]: the one list of strategy names. parse_strategy, its error messages, the
# CLI's --strategy help and remat.__all__ read it; each factory takes the parameters that
# ``parse_strategy("name(...)")`` passes, positionally or by keyword.
STRATEGIES: dict[str, Callable[..., Strategy]] = {
    "none": KeepAll,
    "full": Full,
    "every_nth": EveryNth,
    "selective": Selective,
    "dynamic": Dynamic,
    "ratio": Ratio,
    "attention_only": functools.partial(ByKind, LayerType.ATTENTION),
    "ffn_only": functools.partial(ByKind, LayerType.FFN),
    "largest": Largest,
    "budget": GreedyBudget,
    "segments": Segments,
    "sqrt": Sqrt,
    "named": Named,
}


# ----------------------------------------------------------------------------------------------------
# The public constructors (remat.full() ...)


def none() -> KeepAll:
    """Keep every block: the baseline."""
    return KeepAll()


def full() -> Full:
    """Checkpoint every block (HuggingFace's gradient_checkpointing_enable); a block that edits the previous
    block's output in place (a split ``nn.ReLU(inplace=True)``) goes in that block's segment."""
    return Full()


def every_nth(n: int) -> EveryNth:
    """Checkpoint blocks 0, n, 2n, ... (the seeds' Uniform(interval) / EveryNthLayer(n)); one that edits its
    input in place (a split ``nn.ReLU(inplace=True)``) is kept, or joins the segment of the block before it.

    Args:
        n: The interval, >= 1.
    """
    return EveryNth(n)


def selective(indices: Sequence[int]) -> Selective:
    """Checkpoint the listed blocks; one that edits its input in place (a split ``nn.ReLU(inplace=True)``)
    is refused with a ``RematError`` (recomputed alone it would edit it again).

    Args:
        indices: Block indices, each >= 0 and listed once.
    """
    return Selective(tuple(indices))


def dynamic(memory_fraction: float, *, min_interval: int = 1) -> Dynamic:
    """Checkpoint every k-th block, k as large as keeps the measured activations within a share.

    Args:
        memory_fraction: Target share of the activations kept with no checkpointing, in [0, 1].
        min_interval: The smallest interval allowed, >= 1.
    """
    return Dynamic(memory_fraction, min_interval)


def ratio(checkpoint_ratio: float) -> Ratio:
    """Checkpoint a share of the blocks, evenly spread (the seed's Selective(checkpoint_ratio)).

    Args:
        checkpoint_ratio: Share of blocks to checkpoint, in [0, 1].
    """
    return Ratio(checkpoint_ratio)


def attention_only(*, min_interval: int = 1) -> ByKind:
    """Checkpoint attention: attention blocks wholly, the attention sub-module of mixed blocks.

    Args:
        min_interval: Only blocks whose index is a multiple of this, >= 1.
    """
    return ByKind(LayerType.ATTENTION, min_interval)


def ffn_only(*, min_interval: int = 1) -> ByKind:
    """Checkpoint feed-forward: FFN blocks wholly, the FFN sub-module of mixed blocks.

    Args:
        min_interval: Only blocks whose index is a multiple of this, >= 1.
    """
    return ByKind(LayerType.FFN, min_interval)


def largest(top_k: int) -> Largest:
    """Checkpoint the ``top_k`` blocks that save the most bytes for backward (measured).

    Args:
        top_k: How many blocks, >= 0.
    """
    return Largest(top_k)


def budget(max_bytes: int | str) -> GreedyBudget:
    """The seed's greedy budget: checkpoint by bytes per recompute ms until saved bytes fit.

    Args:
        max_bytes: Saved activations allowed, bytes or a size such as ``"200MiB"``, >= 0.
    """
    return GreedyBudget(max_bytes)  # type: ignore[arg-type]  # parsed to bytes in __post_init__


def segments(k: int) -> Segments:
    """Cut the blocks into ``k`` even segments and checkpoint all but the last; a segment never starts at a
    block that edits its input in place (a split ``nn.ReLU(inplace=True)``): the cut moves after it.

    Args:
        k: Number of segments, >= 1.
    """
    return Segments(k)


def sqrt() -> Sqrt:
    """``segments(round(sqrt(n)))``: the classic O(sqrt n) memory schedule (cuts after in-place blocks)."""
    return Sqrt()


def named(groups: Sequence[Sequence[str] | str]) -> Named:
    """Checkpoint named blocks (NNTrainer's ``addCheckpointBlock``): each group's inside is recomputed.

    Args:
        groups: Lists of consecutive sibling module FQNs; each list is one block.
    """
    return Named(tuple(tuple(g) if not isinstance(g, str) else (g,) for g in groups))


# ----------------------------------------------------------------------------------------------------
# Reading strategies from text, and the bench's representatives


# One well-formed text per strategy that takes parameters, for the message when a text does not fit its
# parameters (tests/plan/test_strategies.py checks that each parses).
EXAMPLES: dict[str, str] = {
    "every_nth": "every_nth(2)",
    "selective": "selective([0, 2])",
    "dynamic": "dynamic(0.5, min_interval=1)",
    "ratio": "ratio(0.5)",
    "attention_only": "attention_only(min_interval=2)",
    "ffn_only": "ffn_only(min_interval=2)",
    "largest": "largest(2)",
    "budget": "budget('200MiB')",
    "segments": "segments(2)",
    "named": "named([['layers.0', 'layers.1']])",
}


def strategy_params(name: str) -> tuple[str, ...]:
    """The parameters of the registered strategy ``name``, in order (``("n",)`` for ``every_nth``).

    Raises:
        KeyError: If ``name`` is not in :data:`STRATEGIES`.
    """
    return tuple(inspect.signature(STRATEGIES[name]).parameters)


def parse_strategy(text: str) -> Strategy:
    """Parse ``"every_nth(2)"``, ``"selective([0, 3])"``, ``"budget('200MiB')"`` or a bare name.

    Raises:
        RematError: For an unknown name or bad parameters (the message lists valid names).
    """
    text = text.strip()
    name, _, rest = text.partition("(")
    name = name.strip()
    if name not in STRATEGIES:
        close = difflib.get_close_matches(name, list(STRATEGIES), n=1)  # as the command line's --strategy
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise RematError(f"strategy: unknown {name!r}; {hint}valid strategies are {', '.join(STRATEGIES)}")
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    if rest:
        if not rest.endswith(")"):
            raise RematError(f"strategy: cannot read {text!r}; write e.g. every_nth(2)")
        bad = RematError(f"strategy: cannot read the parameters of {text!r}; use literals, e.g. selective([0, 3])")
        try:
            call = ast.parse(f"f({rest}", mode="eval").body
            if not isinstance(call, ast.Call):
                raise bad
            args = tuple(ast.literal_eval(a) for a in call.args)
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
        except (SyntaxError, ValueError):
            raise bad from None
    try:
        return STRATEGIES[name](*args, **kwargs)
    except TypeError:
        example = EXAMPLES.get(name, name)
        raise RematError(
            f"strategy: {text!r} does not match {name}({', '.join(strategy_params(name))}); write e.g. {example}"
        ) from None


def bench_strategies(blocks: Sequence[Block], profile: Profile | None) -> list[Strategy]:
    """One representative instance of every registered strategy that makes sense for ``blocks``.

    Strategies that read sizes are left out without a profile, segment rules on blocks that do not form
    a chain, attention/FFN rules where there is no such block, and ``named`` (it names its own blocks).

    Args:
        blocks: The blocks to plan over.
        profile: Their profile, or ``None``.

    Returns:
        The instances, in registry order.
    """
    n = len(blocks)
    chain = n >= 4 and (profile is None or profile.is_chain)
    has = {kind: any(b.type_hint is kind or _subs(b, kind) for b in blocks) for kind in _KINDS}
    examples: dict[str, Strategy | None] = {
        "none": KeepAll(),
        "full": Full(),
        "every_nth": EveryNth(2) if n >= 2 else None,
        "selective": Selective((0, n // 2)) if n >= 3 else None,
        "dynamic": Dynamic(0.5) if profile is not None else None,
        "ratio": Ratio(0.5),
        "attention_only": ByKind(LayerType.ATTENTION) if has[LayerType.ATTENTION] else None,
        "ffn_only": ByKind(LayerType.FFN) if has[LayerType.FFN] else None,
        "largest": Largest(max(1, n // 4)) if profile is not None else None,
        "budget": GreedyBudget(sum(bp.saved_bytes for bp in profile.block_profiles) // 2)
        if profile is not None
        else None,
        "segments": Segments(2) if chain else None,
        "sqrt": Sqrt() if chain else None,
    }
    return [s for s in (examples.get(name) for name in STRATEGIES) if s is not None]
