"""Every classic checkpointing rule from the reference documents, as small validated frozen dataclasses.

Each strategy answers which blocks it checkpoints (``checkpointed``/``should_checkpoint``), turns that
into plan operations (``ops``) and describes itself (``summary``). Strategies that need sizes
(``largest``, ``budget``, ``dynamic``) read a measured :class:`remat.profile.Profile`.
"""

from __future__ import annotations

import ast
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

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
    "STRATEGIES",
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
    "bench_strategies",
]


class Strategy:
    """Shared behaviour of the strategies (each subclass is a frozen dataclass with its parameters)."""

    name: ClassVar[str]
    needs_profile: ClassVar[bool] = False

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        """Indices of the blocks this strategy checkpoints (wholly or through a sub-module)."""
        raise NotImplementedError

    def should_checkpoint(self, index: int, blocks: Sequence[Block], profile: Profile | None = None) -> bool:
        """Whether block ``index`` is checkpointed."""
        return index in self.checkpointed(blocks, profile)

    def ops(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[Op, ...]:
        """The plan operations: each checkpointed block under its own checkpoint."""
        return single_level_ops(len(blocks), frozenset(self.checkpointed(blocks, profile)))

    @property
    def label(self) -> str:
        """Name and parameters, e.g. ``'every_nth(n=2)'``."""
        params = ", ".join(f"{f.name}={_short(getattr(self, f.name))}" for f in fields(self))  # type: ignore[arg-type]
        return f"{self.name}({params})" if params else self.name

    def summary(self) -> str:
        """One line describing the rule."""
        return f"{self.label}: {self._describe()}"

    def _describe(self) -> str:
        raise NotImplementedError

    def _sizes(self, profile: Profile | None, n: int) -> Profile:
        if profile is None:
            raise RematError(
                f"strategy {self.name}: needs measured block sizes; pass profile=remat.profile(model, inputs, loss_fn)"
            )
        if len(profile.block_profiles) != n:
            raise RematError(
                f"strategy {self.name}: the profile has {len(profile.block_profiles)} blocks but the model has {n}; "
                "profile the same blocks you apply to"
            )
        return profile

    @classmethod
    def example(cls, blocks: Sequence[Block], profile: Profile | None) -> Strategy | None:
        """A representative instance for a bench over ``blocks`` (``None``: not meaningful here)."""
        return None


def _short(v: Any) -> str:
    if isinstance(v, tuple) and len(v) > 6:
        return f"({', '.join(map(str, v[:6]))}, ...)"
    return repr(v) if isinstance(v, str) else str(v)


def _check_int(strategy: str, param: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RematError(f"strategy {strategy}: {param}={value!r} is invalid; it must be an integer >= {low}")


def _check_fraction(strategy: str, param: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise RematError(f"strategy {strategy}: {param}={value!r} is outside [0, 1]; give a fraction such as 0.5")


@dataclass(frozen=True)
class _None(Strategy):
    name: ClassVar[str] = "none"

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        return ()

    def _describe(self) -> str:
        return "keep every block (no checkpointing)"

    @classmethod
    def example(cls, blocks: Sequence[Block], profile: Profile | None) -> Strategy | None:
        return cls()


@dataclass(frozen=True)
class _Full(Strategy):
    name: ClassVar[str] = "full"

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        return tuple(range(len(blocks)))

    def _describe(self) -> str:
        return "checkpoint every block"

    @classmethod
    def example(cls, blocks: Sequence[Block], profile: Profile | None) -> Strategy | None:
        return cls()


@dataclass(frozen=True)
class _EveryNth(Strategy):
    n: int
    name: ClassVar[str] = "every_nth"

    def __post_init__(self) -> None:
        _check_int(self.name, "n", self.n, 1)

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        return tuple(i for i in range(len(blocks)) if i % self.n == 0)

    def _describe(self) -> str:
        return f"checkpoint blocks 0, {self.n}, {2 * self.n}, ... (uniform interval)"

    @classmethod
    def example(cls, blocks: Sequence[Block], profile: Profile | None) -> Strategy | None:
        return cls(2) if len(blocks) >= 2 else None


@dataclass(frozen=True)
class _Selective(Strategy):
    indices: tuple[int, ...]
    name: ClassVar[str] = "selective"

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

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        beyond = [i for i in self.indices if i >= len(blocks)]
        if beyond:
            raise RematError(
                f"strategy selective: indices {beyond} are out of range for {len(blocks)} blocks (valid 0..{len(blocks) - 1})"
            )
        return tuple(sorted(self.indices))

    def _describe(self) -> str:
        return f"checkpoint blocks {list(self.indices)}"

    @classmethod
    def example(cls, blocks: Sequence[Block], profile: Profile | None) -> Strategy | None:
        n = len(blocks)
        return cls((0, n // 2)) if n >= 3 else None


def _retained(profile: Profile, chosen: set[int] | frozenset[int]) -> int:
    # Bytes held after the forward when `chosen` blocks are checkpointed one by one (measured sizes).
    return sum(bp.output_bytes if i in chosen else bp.keep_bytes for i, bp in enumerate(profile.block_profiles))


@dataclass(frozen=True)
class _Dynamic(Strategy):
    memory_fraction: float
    min_interval: int = 1
    name: ClassVar[str] = "dynamic"
    needs_profile: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_fraction(self.name, "memory_fraction", self.memory_fraction)
        _check_int(self.name, "min_interval", self.min_interval, 1)

    def interval(self, blocks: Sequence[Block], profile: Profile | None) -> int | None:
        """The largest checkpoint interval whose measured retained bytes meet the target (None: keep all)."""
        prof = self._sizes(profile, len(blocks))
        n = len(blocks)
        target = self.memory_fraction * _retained(prof, frozenset())
        if _retained(prof, frozenset()) <= target:
            return None
        for k in range(max(n, self.min_interval), self.min_interval - 1, -1):
            if _retained(prof, frozenset(range(0, n, k))) <= target:
                return k
        log.warning(
            "strategy dynamic: no interval >= %d keeps the activations within %.0f%%; using interval %d",
            self.min_interval,
            self.memory_fraction * 100,
            self.min_interval,
        )
        return self.min_interval

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        k = self.interval(blocks, profile)
        return () if k is None else tuple(range(0, len(blocks), k))

    def _describe(self) -> str:
        return (
            f"checkpoint every k-th block, k the largest interval (>= {self.min_interval}) keeping the measured "
            f"activations within {self.memory_fraction:.0%} of keeping everything"
        )

    @classmethod
    def example(cls, blocks: Sequence[Block], profile: Profile | None) -> Strategy | None:
        return cls(0.5) if profile is not None else None


@dataclass(frozen=True)
class _Ratio(Strategy):
    checkpoint_ratio: float
    name: ClassVar[str] = "ratio"

    def __post_init__(self) -> None:
        _check_fraction(self.name, "checkpoint_ratio", self.checkpoint_ratio)

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        n = len(blocks)
        count = round(self.checkpoint_ratio * n)
        if count == 0:
            return ()
        step = max(1, round(n / count))
        return tuple(i for i in range(0, n, step))[:count]

    def _describe(self) -> str:
        return f"checkpoint {self.checkpoint_ratio:.0%} of the blocks, evenly spread"

    @classmethod
    def example(cls, blocks: Sequence[Block], profile: Profile | None) -> Strategy | None:
        return cls(0.5)


def _by_type(strategy: Strategy, kind: LayerType, min_interval: int, blocks: Sequence[Block]) -> tuple[Op, ...]:
    ops: list[Op] = []
    for i, b in enumerate(blocks):
        subs = b.attention_fqns if kind is LayerType.ATTENTION else b.ffn_fqns
        if i % min_interval != 0:
            ops.append(Keep(i))
        elif b.type_hint is kind:
            ops.append(Recompute(i, i + 1, (Keep(i),)))
        elif subs:
            ops.append(RecomputeSub(i, subs))
        else:
            ops.append(Keep(i))
    if all(isinstance(op, Keep) for op in ops) and not any(
        b.type_hint is kind or (b.attention_fqns if kind is LayerType.ATTENTION else b.ffn_fqns) for b in blocks
    ):
        what = "attention" if kind is LayerType.ATTENTION else "feed-forward (MLP)"
        raise RematError(
            f"strategy {strategy.name}: found no {what} block or sub-module in the {len(blocks)} blocks "
            f"({blocks[0].name if blocks else '-'}..{blocks[-1].name if blocks else '-'}), so it would checkpoint "
            "nothing; use another strategy (full(), remat.plan(profile, budget)) or choose the blocks yourself"
        )
    return tuple(ops)


@dataclass(frozen=True)
class _AttentionOnly(Strategy):
    min_interval: int = 1
    name: ClassVar[str] = "attention_only"

    def __post_init__(self) -> None:
        _check_int(self.name, "min_interval", self.min_interval, 1)

    def ops(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[Op, ...]:
        return _by_type(self, LayerType.ATTENTION, self.min_interval, blocks)

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        return tuple(
            op.index if isinstance(op, RecomputeSub) else op.start
            for op in self.ops(blocks)
            if not isinstance(op, Keep)
        )

    def _describe(self) -> str:
        return f"checkpoint attention (whole attention blocks, or the attention inside mixed blocks), every {self.min_interval}"

    @classmethod
    def example(cls, blocks: Sequence[Block], profile: Profile | None) -> Strategy | None:
        return cls() if any(b.type_hint is LayerType.ATTENTION or b.attention_fqns for b in blocks) else None


@dataclass(frozen=True)
class _FfnOnly(Strategy):
    min_interval: int = 1
    name: ClassVar[str] = "ffn_only"

    def __post_init__(self) -> None:
        _check_int(self.name, "min_interval", self.min_interval, 1)

    def ops(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[Op, ...]:
        return _by_type(self, LayerType.FFN, self.min_interval, blocks)

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        return tuple(
            op.index if isinstance(op, RecomputeSub) else op.start
            for op in self.ops(blocks)
            if not isinstance(op, Keep)
        )

    def _describe(self) -> str:
        return f"checkpoint feed-forward (whole FFN blocks, or the FFN inside mixed blocks), every {self.min_interval}"

    @classmethod
    def example(cls, blocks: Sequence[Block], profile: Profile | None) -> Strategy | None:
        return cls() if any(b.type_hint is LayerType.FFN or b.ffn_fqns for b in blocks) else None


@dataclass(frozen=True)
class _Largest(Strategy):
    top_k: int
    name: ClassVar[str] = "largest"
    needs_profile: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_int(self.name, "top_k", self.top_k, 0)

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        prof = self._sizes(profile, len(blocks))
        if self.top_k > len(blocks):
            raise RematError(
                f"strategy largest: top_k={self.top_k} exceeds the {len(blocks)} blocks; use 0..{len(blocks)}"
            )
        order = sorted(range(len(blocks)), key=lambda i: (-prof.block_profiles[i].saved_bytes, i))
        return tuple(sorted(order[: self.top_k]))

    def _describe(self) -> str:
        return f"checkpoint the {self.top_k} blocks that save the most bytes for backward (measured)"

    @classmethod
    def example(cls, blocks: Sequence[Block], profile: Profile | None) -> Strategy | None:
        return cls(max(1, len(blocks) // 4)) if profile is not None else None


@dataclass(frozen=True)
class _Budget(Strategy):
    max_bytes: int
    name: ClassVar[str] = "budget"
    needs_profile: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, (int, float)) and not isinstance(self.max_bytes, bool) and self.max_bytes < 0:
            raise RematError(
                f"strategy budget: max_bytes={self.max_bytes!r} is negative; give bytes >= 0 or a size like '200MiB'"
            )
        object.__setattr__(self, "max_bytes", parse_bytes(self.max_bytes))

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        prof = self._sizes(profile, len(blocks))
        saved = [bp.saved_bytes for bp in prof.block_profiles]
        remaining = sum(saved)
        chosen: set[int] = set()
        # The seed's greedy: most bytes saved per unit of recompute cost first (measured forward time).
        order = sorted(range(len(blocks)), key=lambda i: (-saved[i] / (prof.block_profiles[i].fwd_ms + 1e-3), i))
        for i in order:
            if remaining <= self.max_bytes:
                break
            chosen.add(i)
            remaining -= saved[i]
        return tuple(sorted(chosen))

    def _describe(self) -> str:
        return f"greedily checkpoint blocks by saved bytes per recompute ms until saved activations <= {format_bytes(self.max_bytes)}"

    @classmethod
    def example(cls, blocks: Sequence[Block], profile: Profile | None) -> Strategy | None:
        if profile is None:
            return None
        return cls(sum(bp.saved_bytes for bp in profile.block_profiles) // 2)


def _segment_bounds(n: int, k: int) -> list[tuple[int, int]]:
    size, extra = divmod(n, k)
    bounds, start = [], 0
    for i in range(k):
        stop = start + size + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _segment_ops(n: int, k: int) -> tuple[Op, ...]:
    # As torch.utils.checkpoint.checkpoint_sequential: every segment but the last is checkpointed.
    ops: list[Op] = []
    bounds = _segment_bounds(n, k)
    for j, (a, b) in enumerate(bounds):
        keeps = tuple(Keep(i) for i in range(a, b))
        ops.extend(keeps if j == len(bounds) - 1 else (Recompute(a, b, keeps),))
    return tuple(ops)


@dataclass(frozen=True)
class _Segments(Strategy):
    k: int
    name: ClassVar[str] = "segments"

    def __post_init__(self) -> None:
        _check_int(self.name, "k", self.k, 1)

    def ops(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[Op, ...]:
        if self.k > len(blocks):
            raise RematError(f"strategy segments: k={self.k} exceeds the {len(blocks)} blocks; use 1..{len(blocks)}")
        return _segment_ops(len(blocks), self.k)

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        return tuple(i for op in self.ops(blocks) if isinstance(op, Recompute) for i in range(op.start, op.stop))

    def _describe(self) -> str:
        return f"cut the blocks into {self.k} even segments; checkpoint all but the last (checkpoint_sequential)"

    @classmethod
    def example(cls, blocks: Sequence[Block], profile: Profile | None) -> Strategy | None:
        return cls(2) if len(blocks) >= 4 and (profile is None or profile.is_chain) else None


@dataclass(frozen=True)
class _Sqrt(Strategy):
    name: ClassVar[str] = "sqrt"

    def ops(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[Op, ...]:
        n = len(blocks)
        return _segment_ops(n, max(1, round(math.sqrt(n)))) if n else ()

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        return tuple(i for op in self.ops(blocks) if isinstance(op, Recompute) for i in range(op.start, op.stop))

    def _describe(self) -> str:
        return "cut the blocks into round(sqrt(n)) segments; checkpoint all but the last"

    @classmethod
    def example(cls, blocks: Sequence[Block], profile: Profile | None) -> Strategy | None:
        return cls() if len(blocks) >= 4 and (profile is None or profile.is_chain) else None


@dataclass(frozen=True)
class _Named(Strategy):
    groups: tuple[tuple[str, ...], ...]
    name: ClassVar[str] = "named"

    def __post_init__(self) -> None:
        if isinstance(self.groups, str) or not self.groups:
            raise RematError(
                f"strategy named: groups={self.groups!r} must be a non-empty list of lists of module names"
            )
        object.__setattr__(self, "groups", tuple((g,) if isinstance(g, str) else tuple(g) for g in self.groups))

    def checkpointed(self, blocks: Sequence[Block], profile: Profile | None = None) -> tuple[int, ...]:
        have = {b.fqns for b in blocks}
        missing = [list(g) for g in self.groups if g not in have]
        if missing:
            raise RematError(
                f"strategy named: {missing} are not blocks here (blocks are {[b.name for b in blocks][:4]}...); "
                "apply it to the model (remat.apply(model, remat.named(...))) or profile with "
                "blocks=remat.blocks(model, named=...)"
            )
        return tuple(i for i, b in enumerate(blocks) if b.fqns in set(self.groups))

    def _describe(self) -> str:
        return (
            f"checkpoint the named blocks {[list(g) for g in self.groups]} (inputs and outputs kept, inside recomputed)"
        )


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        _None,
        _Full,
        _EveryNth,
        _Selective,
        _Dynamic,
        _Ratio,
        _AttentionOnly,
        _FfnOnly,
        _Largest,
        _Budget,
        _Segments,
        _Sqrt,
        _Named,
    )
}


def none() -> Strategy:
    """Keep every block: the baseline."""
    return _None()


def full() -> Strategy:
    """Checkpoint every block (HuggingFace's gradient_checkpointing_enable)."""
    return _Full()


def every_nth(n: int) -> Strategy:
    """Checkpoint blocks 0, n, 2n, ... (the seeds' Uniform(interval) / EveryNthLayer(n)).

    Args:
        n: The interval, >= 1.
    """
    return _EveryNth(n)


def selective(indices: Sequence[int]) -> Strategy:
    """Checkpoint the listed blocks.

    Args:
        indices: Block indices, each >= 0 and listed once.
    """
    return _Selective(tuple(indices))


def dynamic(memory_fraction: float, *, min_interval: int = 1) -> Strategy:
    """Checkpoint every k-th block, k as large as keeps the measured activations within a share.

    Args:
        memory_fraction: Target share of the activations kept with no checkpointing, in [0, 1].
        min_interval: The smallest interval allowed, >= 1.
    """
    return _Dynamic(memory_fraction, min_interval)


def ratio(checkpoint_ratio: float) -> Strategy:
    """Checkpoint a share of the blocks, evenly spread (the seed's Selective(checkpoint_ratio)).

    Args:
        checkpoint_ratio: Share of blocks to checkpoint, in [0, 1].
    """
    return _Ratio(checkpoint_ratio)


def attention_only(*, min_interval: int = 1) -> Strategy:
    """Checkpoint attention: attention blocks wholly, the attention sub-module of mixed blocks.

    Args:
        min_interval: Only blocks whose index is a multiple of this, >= 1.
    """
    return _AttentionOnly(min_interval)


def ffn_only(*, min_interval: int = 1) -> Strategy:
    """Checkpoint feed-forward: FFN blocks wholly, the FFN sub-module of mixed blocks.

    Args:
        min_interval: Only blocks whose index is a multiple of this, >= 1.
    """
    return _FfnOnly(min_interval)


def largest(top_k: int) -> Strategy:
    """Checkpoint the ``top_k`` blocks that save the most bytes for backward (measured).

    Args:
        top_k: How many blocks, >= 0.
    """
    return _Largest(top_k)


def budget(max_bytes: int | str) -> Strategy:
    """The seed's greedy budget: checkpoint by bytes per recompute ms until saved bytes fit.

    Args:
        max_bytes: Saved activations allowed, bytes or a size such as ``"200MiB"``, >= 0.
    """
    return _Budget(max_bytes)  # type: ignore[arg-type]


def segments(k: int) -> Strategy:
    """Cut the blocks into ``k`` even segments and checkpoint all but the last.

    Args:
        k: Number of segments, >= 1.
    """
    return _Segments(k)


def sqrt() -> Strategy:
    """``segments(round(sqrt(n)))``: the classic O(sqrt n) memory schedule."""
    return _Sqrt()


def named(groups: Sequence[Sequence[str] | str]) -> Strategy:
    """Checkpoint named blocks (NNTrainer's ``addCheckpointBlock``): each group's inside is recomputed.

    Args:
        groups: Lists of consecutive sibling module FQNs; each list is one block.
    """
    return _Named(tuple(tuple(g) if not isinstance(g, str) else (g,) for g in groups))


def parse_strategy(text: str) -> Strategy:
    """Parse ``"every_nth(2)"``, ``"selective([0, 3])"``, ``"budget('200MiB')"`` or a bare name.

    Raises:
        RematError: For an unknown name or bad parameters (the message lists valid names).
    """
    text = text.strip()
    name, _, rest = text.partition("(")
    name = name.strip()
    if name not in STRATEGIES:
        raise RematError(f"strategy: unknown {name!r}; valid strategies are {', '.join(STRATEGIES)}")
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
    cls = STRATEGIES[name]
    if name == "selective" and args:
        args = (tuple(args[0]) if isinstance(args[0], (list, tuple)) else args[0],)
    try:
        return cls(*args, **kwargs)
    except TypeError:
        params = ", ".join(f.name for f in fields(cls))  # type: ignore[arg-type]
        raise RematError(f"strategy: {text!r} does not match {name}({params})") from None


def bench_strategies(blocks: Sequence[Block], profile: Profile | None) -> list[Strategy]:
    """One representative instance of every registered strategy that makes sense for ``blocks``."""
    out = []
    for cls in STRATEGIES.values():
        inst = cls.example(blocks, profile)
        if inst is not None:
            out.append(inst)
    return out
